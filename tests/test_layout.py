"""The package layout is the architecture: imports inside prism_backend point down the layers only,
and no module imports itself back through another (lazy imports inside functions included).

    serving  ->  engine  ->  text  ->  model  ->  kernels (cpu/, triton/)
    (config, errors, forest, prefix_cache, paths, processes, reproducibility at the top of
    prism_backend: importable by all)

kernels/ imports nothing of Prism's, kernels/cpu/ nothing of kernels/triton/ (importing the CPU
kernels must never define a Triton-lang kernel: TRITON_INTERPRET is read then), and the packages'
__init__ files import nothing.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "prism_backend"
# Higher layers may import lower ones; the shared top-level modules import only each other.
LAYERS = {"": 0, "model": 1, "text": 2, "engine": 3, "serving": 4}
KERNELS = PACKAGE.parent / "kernels"
KERNELS_USERS = {"model"}  # Prism's kernels (CPU and Triton-lang) are the model's business alone


def module_name(path: Path) -> str:
    """prism_backend/model/quant.py -> prism_backend.model.quant, kernels/cpu/__init__.py -> kernels.cpu."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (lazy imports count)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from . import x`
    return found


def graph() -> dict[str, set[str]]:
    """prism_backend module -> the prism_backend modules, kernels modules and Triton utils it imports."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def relevant(target: str) -> bool:
        return target in modules or target.split(".")[0] in ("kernels", "triton_python_backend_utils")

    return {name: {t for t in imports_of(path) if relevant(t) and t != name} for name, path in modules.items()}


def layer(module: str) -> str:
    """prism_backend.config -> "" (the top), prism_backend.model.quant -> "model"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def test_imports_point_down_the_layers():
    upward = []
    for module, imported in graph().items():
        for target in imported:
            if target.split(".")[0] == "triton_python_backend_utils":
                upward.append(f"{module} imports Triton's {target}: only model_repository/ may")
            elif target.split(".")[0] == "kernels":
                if layer(module) not in KERNELS_USERS:
                    upward.append(f"{module} imports {target}: only the model layer calls kernels")
            elif layer(target) != layer(module) and LAYERS[layer(target)] >= LAYERS[layer(module)]:
                upward.append(f"{module} ({layer(module) or 'top'}) imports {target} ({layer(target) or 'top'})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles():
    edges = {m: {t for t in targets if t.startswith("prism_backend")} for m, targets in graph().items()}
    cycles, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_kernels_import_nothing_of_prism():
    paths = sorted(KERNELS.rglob("*.py"))
    assert {p.parent.name for p in paths} >= {"kernels", "cpu", "triton"}, "the subpackages were not walked"
    for path in paths:
        assert not any(m.startswith(("prism_backend", "prism_client")) for m in imports_of(path)), path


def test_cpu_kernels_import_no_triton_lang_kernel():
    for path in sorted((KERNELS / "cpu").rglob("*.py")):
        imported = imports_of(path)
        assert not any(m == "triton" or m.startswith(("triton.", "kernels.triton")) for m in imported), path


def test_kernel_package_inits_import_nothing():
    """`import kernels.cpu.exact_gemm` runs kernels/__init__.py and kernels/cpu/__init__.py: were they to
    import a kernels.triton module, it would bind its kernels before conftest sets TRITON_INTERPRET."""
    for path in sorted(KERNELS.rglob("__init__.py")):
        assert not imports_of(path), path
