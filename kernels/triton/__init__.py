"""OpenAI Triton-lang kernels for Prism's GPU path (exact int8 GEMM, tree attention) and their GPU
check. Nothing is imported here: a kernel is bound to Triton's interpreter or compiler when its module
is imported, so TRITON_INTERPRET must be set before (tests/conftest.py does it without a GPU).

Inside this package `import triton` is still OpenAI's triton: imports are absolute."""


def launch_options(device, num_warps: int, num_stages: int | None) -> dict:
    """A kernel launch's compile options: none through the CPU interpreter; on a GPU no FMA
    contraction (the epilogues round like their torch references, step by step) and the tile's
    warps and pipeline stages (None: Triton's default)."""
    if device.type == "cpu":
        return {}
    return {"enable_fp_fusion": False, "num_warps": num_warps,
            **({} if num_stages is None else {"num_stages": num_stages})}
