"""Prism vs vLLM vs Hugging Face, on one machine, in one run (`make bench`, `prism bench`).

    .venv/bin/python bench/side_by_side.py [--repeats 5] [--quick]

Engines
  prism engine int8 / exact / fp32  the engine in-process (prefix cache off: every ticket is new) in
                               each precision: int8 the default (8-bit products on the rotated,
                               GPTQ-rounded model), exact the 13-bit scheme
  prism triton int8 / exact / fp32  the same through a real tritonserver over HTTP (PrismClient)
  HF generic fp32 / bf16       transformers, one forward per question, full-vocabulary softmax
  vLLM bf16|fp32 prefix on/off vLLM's CPU build (.venv-vllm), candidate logprobs via logprob_token_ids,
                               in its fastest dtype on this CPU (vllm_driver.fastest_dtype: fp32 where
                               the CPU has no bf16 dot products, which vLLM's bf16 then emulates)
  vLLM W8A8 prefix on          the same serving a compressed-tensors W8A8 checkpoint made by
                               llm-compressor (SmoothQuant + GPTQ; bench/w8a8_checkpoint.py), where
                               `make bench` could make one
  llama.cpp Q8_0               llama-cpp-python built for this CPU (.venv-llama), the checkpoint
                               converted to GGUF Q8_0, KV cache reused over each prompt's longest
                               common prefix with the previous one (bench/llama_cpp_driver.py)
Workloads
  (a) a new ~600-token ticket, 3 questions        (b) 3 unrelated tickets, 1 question each
  (c) 3 questions whose materials share 0-95% of a fixed length
  (d) requests/s at concurrency 1, 4, 8 against the Prism and vLLM servers
  (e) the probability error on the eval subset (`--eval-limit` documents of each set) against Prism
      fp32: Prism's int8 default and its 8-bit rung beside vLLM (its dtype) and vLLM W8A8, on the same
      prompt tokens
The ratio targets pair each peer with Prism's default alternately (peers_alternately); vLLM W8A8 is
also paired with the 8-bit rung (`keep_exact=''`), the same bit width as the checkpoint.
Every repeat uses a ticket no engine has seen (a numbered first line), so no cache can answer it.
Also: peak memory of each engine, this machine's int8 and bf16 matmul peaks and the fraction of
the int8 peak Prism reaches on (a). Writes bench/results/side_by_side.md and speedup_vs_shared.png.

`--force-avx2` (`make bench-forced-avx2`) runs the same on an AVX-512 machine acting as an AVX2-only
one, every engine in its AVX2 build or path (bench/forced_avx2.py: a stand-in for the AVX2 kind, not
that kind), against the AVX2 kind's targets; without vLLM W8A8 (vLLM's int8 products need AVX-512)
and without Hugging Face bf16 (emulated there, and no target's peer). Writes
side_by_side-forced-avx2.md and speedup_vs_shared-forced-avx2.png.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import forced_avx2  # noqa: E402 (bench/, this script's folder)

ROOT = Path(__file__).resolve().parent.parent
from llama_cpp_driver import DEFAULT_GGUF, LLAMA_PYTHON, convert, llama_cpp_session, run_llama_cpp  # noqa: E402
from vllm_driver import DTYPE_NAMES, VLLM_PYTHON, fastest_dtype, run_vllm, vllm_session  # noqa: E402
from w8a8_checkpoint import DEFAULT_W8A8  # noqa: E402
from workloads import OTHER_TICKETS, RESULTS, SHARED_TICKET, eval_tickets, write_result  # noqa: E402

from kernels.cpu.exact_gemm import amx8_available  # noqa: E402
from kernels.cpu.features import has_avx512_vnni, machine  # noqa: E402
from prism_backend.config import EngineConfig  # noqa: E402
from prism_launcher.reference import HFReference  # noqa: E402
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH as REGISTRY  # noqa: E402
from prism_backend.processes import free_port  # noqa: E402
from prism_backend.serving.pipeline import DecisionPipeline  # noqa: E402
from prism_client.client import PrismClient  # noqa: E402
from prism_launcher.server import ServerOptions, TritonServer  # noqa: E402

CPUS = sorted(os.sched_getaffinity(0))  # `taskset -c 1 ...` runs every engine on core 1 only
THREADS = len(CPUS)
LOG = ROOT / ".run" / "vllm_server.log"  # git-ignored
MEASUREMENTS = ROOT / ".run" / "side_by_side"  # + .pkl / .forced-avx2.pkl: the last run's, for --report-from
QUESTIONS = ["team", "reply_time", "severity"]
FILLER = eval_tickets()


# ------------------------------------------------------------------------------------ workloads
def workload_a(n: int) -> list[dict]:
    return [{"material": f"Ticket #{n}-A\n{SHARED_TICKET}", "tasks": QUESTIONS}]


def workload_b(n: int) -> list[dict]:
    return [{"material": f"Ticket #{n}-B{i}\n{t}", "tasks": [q]} for i, (t, q) in enumerate(zip(OTHER_TICKETS, QUESTIONS))]


def workload_c(n: int, shared_fraction: float, length_words: int = 400) -> list[dict]:
    """3 questions; their materials share the first `shared_fraction` of `length_words` words."""
    words = " ".join(FILLER).split()
    shared = int(length_words * shared_fraction)
    head = [f"Ticket #{n}-C"] + words[:shared]
    out = []
    for i, q in enumerate(QUESTIONS):
        own = words[(i + 1) * 1000 : (i + 1) * 1000 + length_words - shared]
        out.append({"material": " ".join(head + [f"Part {i}:"] + own), "tasks": [q]})
    return out


SHARED_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 0.95)  # the (c) sweep


def workload_makers(fractions=SHARED_FRACTIONS) -> dict:
    """name -> make(ticket number) -> batch: (a), (b) and the (c) sweep at `fractions`."""
    makers = {"a: 1 ticket x 3 questions": workload_a, "b: 3 tickets x 1 question": workload_b}
    for f in fractions:
        makers[f"c: shared {int(100 * f)}%"] = lambda n, f=f: workload_c(n, f)
    return makers


def timed(fn, batches) -> list[float]:
    fn(batches[0])  # warm-up on its own ticket
    times = []
    for batch in batches[1:]:
        t0 = time.perf_counter()
        fn(batch)
        times.append(time.perf_counter() - t0)
    return times


def alternate(run: dict, make, tickets, rounds: int) -> dict[str, list[float]]:
    """Seconds per batch of each sender in `run` (name -> send(batch)), measured alternately: every
    round one new batch (`make(ticket number)`) through each, the order reversed every other round;
    round 0 warms each up on its own tickets, untimed. What a ratio of two of them needs on a shared
    machine, where two phases minutes apart can differ by more than the ratio being measured
    (docs/results.md); an idle sender (a server waiting on its queues) takes no CPU while the other runs.
    A sender that returns a float has timed itself (a peer's driver, around its engine's work as in
    its phase): that is its time, instead of the wall clock around the call."""
    times: dict[str, list[float]] = {name: [] for name in run}
    for round_ in range(rounds + 1):
        for name in (run if round_ % 2 == 0 else reversed(list(run))):
            batch = make(next(tickets))
            start = time.perf_counter()
            took = run[name](batch)
            if round_:
                times[name].append(took if isinstance(took, float) else time.perf_counter() - start)
    return times


def peers_alternately(engine_send, sessions: dict, ticket, ids, rounds: int) -> dict[str, dict[str, dict]]:
    """Prism's engine (`engine_send(batch)`) against each peer in turn on (a) and (b), alternately
    (`alternate`): sessions, label -> a function starting the peer's driver session
    (driver_io.DriverSession, which keeps the peer stopped while Prism runs); ids: a batch's prompt and
    candidate ids. -> workload -> label -> {"prism": seconds, "peer": seconds} per round."""
    makers = workload_makers(())  # (a) and (b)
    out: dict[str, dict[str, dict]] = {w: {} for w in makers}
    for label, start in sessions.items():
        print(label + ", alternately", flush=True)
        with start() as session:
            for w, make in makers.items():
                out[w][label] = alternate({"prism": engine_send, "peer": lambda batch: session.call(ids(batch))["seconds"]},
                                          make, ticket, rounds)
            session.close()
    return out


LLAMA_LABEL = "llama.cpp Q8_0, KV prefix reuse"
W8A8_LABEL = "vLLM W8A8 (llm-compressor) prefix on"
# The W8A8 checkpoint's fastest activation dtype also where the CPU has no bf16 dot products (its
# products are int8 either way): on (a), 0.58 s in bf16 against 0.70-0.87 s in fp32 (Intel Xeon,
# Ice Lake, AVX-512 VNNI without BF16, 2026-12-06)
W8A8_DTYPE = "bfloat16"
EXACT_LABEL = "prism engine exact (13-bit)"
EIGHT_BIT_LABEL = "prism engine int8, every projection 8-bit"  # keep_exact='': faster, ~1.6x the default's error


def vllm_label(dtype: str, prefix_caching: bool = True) -> str:
    """A vLLM engine's label in the results, e.g. 'vLLM bf16 prefix on' (dtype as vLLM's --dtype)."""
    return f"vLLM {DTYPE_NAMES[dtype]} prefix {'on' if prefix_caching else 'off'}"


VLLM_BF16_LABEL = vllm_label("bfloat16")  # the AMX plan's peer (CPUs with AMX have bf16 dot products)
AMX_PLAN = "qkv,down:1+2"  # down_proj's 13-bit weights with 8-bit activations: two AMX tile products, not four
AMX_PLAN_LABEL = f"prism engine int8, keep_exact={AMX_PLAN}"


def peer_sessions(model_dir: Path, w8a8_dir: Path | None, gguf: Path, vllm: bool, dtype: str = "bfloat16",
                  other_dtype: str | None = None) -> dict:
    """peers_alternately's `sessions`: label -> a function starting that peer's driver session. vLLM
    (where `vllm`) in `dtype` with and without prefix caching, in `other_dtype` with it where given,
    serving the W8A8 checkpoint where there is one (in W8A8_DTYPE); llama.cpp where its virtualenv is
    (the GGUF converted if missing)."""
    runs = []
    if vllm:
        runs = [(vllm_label(dtype, on), model_dir, dtype, on) for on in (True, False)]
        runs += [(vllm_label(other_dtype), model_dir, other_dtype, True)] if other_dtype else []
        runs += [(W8A8_LABEL, w8a8_dir, W8A8_DTYPE, True)] if w8a8_dir is not None and w8a8_dir.exists() else []
    sessions = {label: (lambda checkpoint=checkpoint, dtype=dtype, on=on: vllm_session(on, checkpoint, dtype))
                for label, checkpoint, dtype, on in runs}
    if LLAMA_PYTHON.exists():
        if not gguf.exists():
            convert(model_dir, gguf)
        sessions[LLAMA_LABEL] = lambda: llama_cpp_session(gguf, THREADS)
    return sessions


def vllm_server_label(dtype: str) -> str:
    """The vLLM server's row in (d), the requests/s table."""
    return f"vLLM server {DTYPE_NAMES[dtype]} prefix on"


def peer_times(run, workloads: dict, prompts: dict, reps: int) -> tuple[dict[str, list[float]], dict]:
    """A peer engine's driver (`run(calls)` -> its OUT dict) on one throw-away call, then every
    workload's calls in order -> (per workload its times without its first, warm-up, ticket; OUT)."""
    calls = [[([1, 2, 3], [4, 5])]] + [call for w in workloads for call in prompts[w]]
    out = run(calls)
    seconds = out["seconds"][1:]
    return {w: seconds[i * (reps + 1) + 1 : (i + 1) * (reps + 1)] for i, w in enumerate(workloads)}, out


# --------------------------------------------------------------------------------------- engines
class PromptIds:
    """Prompt and candidate ids of every question, from Prism's tokenizer step (all engines see the
    same tokens)."""

    def __init__(self, model_dir: Path):
        self.pipeline = DecisionPipeline(EngineConfig(model_dir=model_dir, precision="fp32", prefix_cache_bytes=0),
                                         REGISTRY)

    def __call__(self, batch: list[dict]) -> list[tuple[list[int], list[int]]]:
        out = []
        for r in batch:
            for t in r["tasks"]:
                enc, _ = self.pipeline.frontend.encode(r["material"], [t], None)
                out.append((list(enc.prompt_ids(0)), list(enc.candidates[0])))
        return out


def peak_rss_of(code: str) -> float:
    """GiB: peak resident memory of a fresh Python process running `code`."""
    probe = code + "\nimport resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, cwd=ROOT)
    return int(out.stdout.strip().splitlines()[-1]) / 2**20


def process_tree_rss(pid: int) -> float:
    """GiB resident in `pid` and its descendants (a server with its stubs and workers)."""
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**30


def matmul_peaks(rounds: int = 5, reps: int = 10) -> dict[str, float]:
    """GOPS of torch._int_mm (int8) and bf16 / fp32 matmul at a large square-ish shape: the fastest
    of `rounds` timings of `reps` products each. A peak is what the machine can reach, so the best
    round, not one round that a slow phase of a shared VM can pull down (one such round measured
    651 GOPS where others measured 771-817, and the forward's share of the peak read 59% for 48%)."""
    m, k, n = 1024, 2048, 2048
    out = {}
    cases = {"int8": (torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.randint(-127, 128, (k, n), dtype=torch.int8),
                      torch._int_mm),
             "bf16": (torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16), torch.matmul),
             "fp32": (torch.randn(m, k), torch.randn(k, n), torch.matmul)}
    for name, (a, b, op) in cases.items():
        op(a, b)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                op(a, b)
            best = min(best, time.perf_counter() - t0)
        out[name] = 2 * m * k * n * reps / best / 1e9
    return out


# ------------------------------------------------------------------------------------- throughput
VLLM_TICKETS = 2 * 10**5  # first ticket number of vLLM's throughput tickets


def prism_tickets(server_index: int) -> int:
    """First ticket number of the throughput tickets of Prism's server_index-th server."""
    return 10**5 + 10**4 * server_index


# Requests per throughput level: at least MIN_THROUGHPUT_REQUESTS. With 2 * concurrency + 2 alone one
# caller sent 4, ~2 s, and the first (after SETTLE_S idle, slower on these VMs' idle cores) weighed a
# quarter: the one-caller ratio read 1.68x and 1.49x in two Zen 4 runs (2026-12-06, -07) whose 4- and
# 8-caller ratios stayed within 0.04 of each other.
MIN_THROUGHPUT_REQUESTS = 12


def throughput_requests(concurrency: int) -> int:
    """How many requests a throughput level sends: every caller busy twice over, plus two, and never
    fewer than MIN_THROUGHPUT_REQUESTS."""
    return max(MIN_THROUGHPUT_REQUESTS, 2 * concurrency + 2)


def throughput_tickets(base: int, concurrency: int) -> list[list[dict]]:
    """throughput_requests(concurrency) new tickets (workload (a) each), none shared with another
    concurrency's or engine's: a ticket sent twice would be a prefix-cache hit for a server that keeps one."""
    return [workload_a(base + 1000 * concurrency + k) for k in range(throughput_requests(concurrency))]


def throughput(send, concurrency: int, requests: list) -> float:
    """Requests/s with `concurrency` callers sending `requests` (prepared before the clock starts)."""
    pending = iter(requests)
    lock = threading.Lock()

    def caller():
        while True:
            with lock:
                request = next(pending, None)
            if request is None:
                return
            send(request)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(caller) for _ in range(concurrency)]:
            f.result()
    return len(requests) / (time.perf_counter() - t0)


def prism_batch_sender(http_port: int):
    """send(batch): a batch's requests to Prism's server over HTTP (PrismClient), sent together, one
    caller each, returning when all are answered."""
    local = threading.local()

    def client() -> PrismClient:
        if not hasattr(local, "client"):  # tritonclient's HTTP client is not thread-safe
            local.client = PrismClient(f"localhost:{http_port}")
        return local.client

    def send(batch: list[dict]) -> None:
        with ThreadPoolExecutor(len(batch)) as pool:
            list(pool.map(lambda r: client().decide(r["material"], r["tasks"]), batch))

    return send


def prism_startup_seconds(options: ServerOptions, caches: Path | None) -> float:
    """Seconds from launching tritonserver to every model ready. caches: empty folders for the
    calibration (GPTQ integers) and the kernel library, so the start computes and builds them
    (cold: a machine's first start); None keeps the usual ones (warm)."""
    saved = {k: os.environ.get(k) for k in ("PRISM_CALIBRATION_CACHE", "PRISM_KERNEL_CACHE")}
    if caches is not None:
        for k, name in (("PRISM_CALIBRATION_CACHE", "calibration"), ("PRISM_KERNEL_CACHE", "kernels")):
            (caches / name).mkdir(parents=True, exist_ok=True)
            os.environ[k] = str(caches / name)
    try:
        t0 = time.perf_counter()
        with TritonServer(options):
            return time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class VllmServer:
    def __init__(self, model_dir: Path, dtype: str):
        self.port = free_port()
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, CPUS)), VLLM_CPU_KVCACHE_SPACE="2")
        LOG.parent.mkdir(exist_ok=True)
        self.log = open(LOG, "w")
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--port", str(self.port), "--dtype", dtype, "--enforce-eager", "--block-size", "32",
             "--enable-prefix-caching", "--served-model-name", "m"], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM server exited; see {LOG}")
                time.sleep(1)
        raise RuntimeError("vLLM server did not start in 300 s")

    def send(self, prompts: list[tuple]) -> None:
        """One request = a ticket's questions, sent at once (candidate sets differ per question, so
        one /v1/completions call each; vLLM batches concurrent calls)."""
        def one(prompt):
            p, c = prompt
            body = json.dumps({"model": "m", "prompt": p, "max_tokens": 1, "logprobs": 1,
                               "logprob_token_ids": c, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=600).read()

        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(one, prompts))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


SETTLE_S = 3.0  # after a run vLLM's threads spin on for ~2 s (a core's third, measured): wait them out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by `pid` and its descendants."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def throughput_in_turn(prism_send, prism_pid: int, prism_base: int, ids, concurrency: list[int], model_dir: Path,
                       dtype: str, startup: dict, memory: dict) -> tuple[list[float], list[float], dict[str, float]]:
    """Requests/s of Prism's server (up, `prism_send`) and vLLM's (started here: its start-up and memory
    recorded) at each concurrency level, one level of each in turn: run as two phases minutes apart, the
    machine's phases moved their ratio by more than the target's margin. The idle server waits on its
    sockets meanwhile; returned with the rates: CPU seconds each server used while the other was timed
    (what shows that it did). vLLM serves in `dtype`."""
    print("vLLM server", flush=True)
    t0 = time.perf_counter()
    server = VllmServer(model_dir, dtype)
    startup[f"vLLM {DTYPE_NAMES[dtype]} (its caches as they are)"] = time.perf_counter() - t0
    prism, vllm, idle = [], [], {"Prism's server while vLLM's ran": 0.0, "vLLM's server while Prism's ran": 0.0}
    try:
        server.send(ids(workload_a(VLLM_TICKETS - 1)))  # warm-up (Prism's server is warm from (a)-(c))
        for c in concurrency:
            requests = [ids(t) for t in throughput_tickets(VLLM_TICKETS, c)]  # tokenised before either clock
            time.sleep(SETTLE_S)
            before = tree_cpu_seconds(server.proc.pid)
            prism.append(throughput(prism_send, c, throughput_tickets(prism_base, c)))
            idle["vLLM's server while Prism's ran"] += tree_cpu_seconds(server.proc.pid) - before
            before = tree_cpu_seconds(prism_pid)
            vllm.append(throughput(server.send, c, requests))
            idle["Prism's server while vLLM's ran"] += tree_cpu_seconds(prism_pid) - before
        memory[vllm_server_label(dtype) + " (server processes)"] = process_tree_rss(server.proc.pid)
    finally:
        server.stop()
    return prism, vllm, idle


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per engine and workload (+1 warm-up)")
    parser.add_argument("--quick", action="store_true", help="2 repeats, 3 sweep points, no fp32 server: a smoke run")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--w8a8-dir", type=Path, default=DEFAULT_W8A8,
                        help="the W8A8 checkpoint vLLM serves (skipped where absent)")
    parser.add_argument("--eval-limit", type=int, default=16, help="(e): documents of each eval set")
    parser.add_argument("--force-avx2", action="store_true",
                        help="this AVX-512 machine as an AVX2-only one, every engine (bench/forced_avx2.py)")
    parser.add_argument("--report-from", type=Path,
                        help="write the page again from a run's measurements (MEASUREMENTS, no engine runs); "
                             "with --force-avx2 for a forced run's")
    args = parser.parse_args()
    if args.force_avx2:
        forced_avx2.reexec()  # returns only once this process runs under its environment
        args.w8a8_dir = None  # vLLM's int8 products need AVX-512
    if args.report_from:
        saved = pickle.loads(args.report_from.read_bytes())
        sys.argv = saved["argv"]
        write_report(argparse.Namespace(**saved["args"]), *saved["inputs"])
        return
    torch.set_num_threads(THREADS)
    reps = 2 if args.quick else args.repeats
    fractions = [0.0, 0.5, 0.95] if args.quick else list(SHARED_FRACTIONS)
    concurrency = [1, 4, 8]
    vllm = not args.no_vllm and VLLM_PYTHON.exists()
    dtype = "float32" if args.force_avx2 else fastest_dtype()  # vLLM's, on this CPU (kind)
    RESULTS.mkdir(exist_ok=True)
    ticket = iter(range(1, 10**6))  # every batch gets its own ticket number

    workloads = {name: [make(next(ticket)) for _ in range(reps + 1)]
                 for name, make in workload_makers(fractions).items()}
    ids = PromptIds(args.model_dir)
    prompts = {w: [ids(b) for b in bs] for w, bs in workloads.items()}
    times: dict[str, dict[str, list[float]]] = {w: {} for w in workloads}
    memory: dict[str, float] = {}

    engine_configs = {  # the default, the all-8-bit plan (the roofline's 8-bit rung), the exact scheme, fp32
        "prism engine int8": dict(precision="int8"),
        EIGHT_BIT_LABEL: dict(precision="int8", keep_exact=""),
        EXACT_LABEL: dict(precision="exact"),
        "prism engine fp32": dict(precision="fp32"),
    }
    if amx8_available():  # the plan that is faster on AMX tiles only (amx_plan_section)
        engine_configs[AMX_PLAN_LABEL] = dict(precision="int8", keep_exact=AMX_PLAN)
    for label, settings in engine_configs.items():
        print(label, flush=True)
        pipeline = DecisionPipeline(EngineConfig(model_dir=args.model_dir, prefix_cache_bytes=0, num_threads=THREADS,
                                                 **settings), REGISTRY)
        for w, bs in workloads.items():
            times[w][label] = timed(pipeline.decide_many, bs)
        forest_tokens = pipeline.decide_many(next(iter(workloads.values()))[0])[1].tokens_computed  # (a)
        del pipeline
    hf_dtypes = {"HF generic fp32": torch.float32}
    if not args.force_avx2:  # bf16 is emulated on the AVX2 path, and no target's peer
        hf_dtypes["HF generic bf16"] = torch.bfloat16
    for label, hf_dtype in hf_dtypes.items():
        print(label, flush=True)
        ref = HFReference(args.model_dir, hf_dtype)
        for w in workloads:
            times[w][label] = timed(lambda ps: [ref.candidate_probabilities(p, c) for p, c in ps], prompts[w])
        del ref
    if vllm:
        for on in (True, False):
            label = vllm_label(dtype, on)
            print(label, flush=True)
            peer, out = peer_times(lambda calls: run_vllm(calls, on, args.model_dir, dtype), workloads, prompts, reps)
            for w, t in peer.items():
                times[w][label] = t
            memory[label + " (offline engine)"] = out["rss_bytes"] / 2**30
        if args.w8a8_dir is not None and args.w8a8_dir.exists():
            print(W8A8_LABEL, flush=True)
            peer, out = peer_times(lambda calls: run_vllm(calls, True, args.w8a8_dir, W8A8_DTYPE), workloads, prompts,
                                   reps)
            for w, t in peer.items():
                times[w][W8A8_LABEL] = t
            memory[W8A8_LABEL + " (offline engine)"] = out["rss_bytes"] / 2**30
    if LLAMA_PYTHON.exists():
        label = LLAMA_LABEL
        print(label, flush=True)
        if not DEFAULT_GGUF.exists():
            convert(args.model_dir, DEFAULT_GGUF)
        peer, out = peer_times(lambda calls: run_llama_cpp(calls, DEFAULT_GGUF, THREADS), workloads, prompts, reps)
        for w, t in peer.items():
            times[w][label] = t
        memory[label + " (process)"] = out["rss_bytes"] / 2**30
    # the peers again, each alternately with Prism's engine: what the ratio targets read
    sessions = peer_sessions(args.model_dir, args.w8a8_dir, DEFAULT_GGUF, vllm, dtype)
    engine = DecisionPipeline(EngineConfig(model_dir=args.model_dir, prefix_cache_bytes=0, num_threads=THREADS), REGISTRY)
    versus = peers_alternately(engine.decide_many, sessions, ticket, ids, reps)
    del engine
    same_width = {}  # W8A8's own bit width: Prism's 8-bit rung against the W8A8 checkpoint, alternately
    if W8A8_LABEL in sessions:
        rung = DecisionPipeline(EngineConfig(model_dir=args.model_dir, prefix_cache_bytes=0, num_threads=THREADS,
                                             **engine_configs[EIGHT_BIT_LABEL]), REGISTRY)
        same_width = peers_alternately(rung.decide_many, {W8A8_LABEL: sessions[W8A8_LABEL]}, ticket, ids, reps)
        del rung
    amx_plan = {}  # the AMX plan against vLLM bf16 with prefix caching, alternately
    if AMX_PLAN_LABEL in engine_configs and VLLM_BF16_LABEL in sessions:
        plan = DecisionPipeline(EngineConfig(model_dir=args.model_dir, prefix_cache_bytes=0, num_threads=THREADS,
                                             **engine_configs[AMX_PLAN_LABEL]), REGISTRY)
        amx_plan = peers_alternately(plan.decide_many, {VLLM_BF16_LABEL: sessions[VLLM_BF16_LABEL]}, ticket, ids, reps)
        del plan

    startup: dict[str, float] = {}  # server start to ready, seconds
    print("server startup", flush=True)
    with tempfile.TemporaryDirectory() as caches:
        for state, folder in (("cold", Path(caches)), ("warm", None)):
            options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                    model_dir=args.model_dir, extra_parameters={"num_threads": str(THREADS)})
            startup[f"Prism int8 ({state}: calibration and kernel library "
                    f"{'computed and built' if state == 'cold' else 'from their caches'})"] = prism_startup_seconds(
                options, folder)
    throughput_rows, idle_cpu = {}, {}
    overhead: dict[str, dict[str, list[float]]] = {}  # workload -> server / engine seconds, alternately
    servers = {  # label: (precision, extra config.pbtxt parameters, whether it also serves (c) and (d))
        "prism triton int8": ("int8", {}, True),
        "prism triton exact (13-bit)": ("exact", {}, True),
        "prism triton fp32": ("fp32", {}, False),
    }
    for index, (label, (precision, parameters, full)) in enumerate(servers.items()):
        if args.quick and label != "prism triton int8":
            continue
        print(label, flush=True)
        # max_queue_wait_s: (d)'s 8 closed-loop callers measure throughput, so every request is
        # admitted (the default 10 s bound answered 503 at 8 callers once a request took ~1.5 s);
        # bench/latency_bench.py measures the bound
        options = ServerOptions(precision=precision, http_port=free_port(), grpc_port=free_port(),
                                metrics_port=free_port(), model_dir=args.model_dir, max_queue_wait_s=600,
                                extra_parameters={"prefix_cache_bytes": "0", "num_threads": str(THREADS), **parameters})
        with TritonServer(options) as server:
            send_batch = prism_batch_sender(options.http_port)
            for w, bs in workloads.items():
                if full or not w.startswith("c"):
                    times[w][label] = timed(send_batch, bs)
            if full:
                memory[label + " (server: tritonserver + stubs)"] = process_tree_rss(server.process.pid)
            if full and vllm and label == "prism triton int8":  # the requests/s target: level by level in turn
                throughput_rows[label], throughput_rows[vllm_server_label(dtype)], idle_cpu = throughput_in_turn(
                    send_batch, server.process.pid, prism_tickets(index), ids, concurrency, args.model_dir, dtype,
                    startup, memory)
            elif full:
                throughput_rows[label] = [throughput(send_batch, c, throughput_tickets(prism_tickets(index), c))
                                          for c in concurrency]
            if label == "prism triton int8":  # the overhead target: server and engine alternately, new tickets
                engine = DecisionPipeline(EngineConfig(model_dir=args.model_dir, prefix_cache_bytes=0,
                                                       num_threads=THREADS), REGISTRY)
                overhead = {w: alternate({"server": send_batch, "engine": engine.decide_many}, make, ticket, reps)
                            for w, make in workload_makers(fractions).items()}
                del engine

    engine_code = ("from prism_backend.config import EngineConfig; from prism_backend.serving.pipeline import DecisionPipeline; "
                   "from pathlib import Path; p = DecisionPipeline(EngineConfig(model_dir=Path({d!r}), precision={p!r}, "
                   "prefix_cache_bytes=0), Path({r!r})); p.decide({t!r}, ['team', 'reply_time', 'severity'])")
    for precision in ("int8", "fp32"):
        memory[f"prism engine {precision} (process peak)"] = peak_rss_of(engine_code.format(
            d=str(args.model_dir), p=precision, r=str(REGISTRY), t=SHARED_TICKET))
    peaks = matmul_peaks()
    print("eval subset", flush=True)
    accuracy = eval_subset(args.model_dir, args.eval_limit, vllm, args.w8a8_dir if vllm else None,
                           {**PRISM_DEFAULT_PLAN, EIGHT_BIT_ERROR_LABEL: engine_configs[EIGHT_BIT_LABEL],
                            **({f"Prism int8, keep_exact={AMX_PLAN}": engine_configs[AMX_PLAN_LABEL]}
                               if AMX_PLAN_LABEL in engine_configs else {})}, dtype)
    inputs = (workloads, times, memory, throughput_rows, concurrency, peaks, fractions, reps, forest_tokens,
              startup, accuracy, overhead, versus, idle_cpu, same_width, amx_plan, dtype)
    MEASUREMENTS.parent.mkdir(exist_ok=True)  # kept first: a page that fails to write costs no rerun
    MEASUREMENTS.with_suffix(".forced-avx2.pkl" if args.force_avx2 else ".pkl").write_bytes(
        pickle.dumps({"argv": sys.argv, "args": vars(args), "inputs": inputs}))
    write_report(args, *inputs)


PRISM_DEFAULT_PLAN = {"Prism int8 (default)": {}}
EIGHT_BIT_ERROR_LABEL = "Prism int8, every projection 8-bit"  # the 8-bit rung's row in (e)


def eval_subset(model_dir: Path, limit: int, vllm: bool, w8a8_dir: Path | None,
                plans: dict[str, dict] = PRISM_DEFAULT_PLAN, dtype: str = "bfloat16") -> dict[str, dict[str, float]]:
    """(e): every engine's probabilities for the first `limit` documents of each eval set, on the
    prompt tokens Prism's fp32 run was given, against that fp32 -> per engine: accuracy against the
    labels, agreement with fp32's choice, mean and max over decisions of max |p - p_fp32|.
    plans: Prism's engines besides fp32, label -> EngineConfig settings; dtype: vLLM's."""
    from evals.run_eval import load, measures, run_engine

    docs = load(limit)
    labels = [t["label"] for d in docs for t in d["tasks"]]
    fp32 = run_engine(EngineConfig(model_dir=model_dir, precision="fp32"), docs, return_prompt_ids=True)
    options = [list(d["probabilities"]) for d in fp32]
    probs = {"Prism fp32": [list(d["probabilities"].values()) for d in fp32]}
    for label, settings in plans.items():
        probs[label] = [list(d["probabilities"].values())
                        for d in run_engine(EngineConfig(model_dir=model_dir, **settings), docs)]
    prompts = [(d["prompt_ids"], d["candidate_ids"]) for d in fp32]
    if vllm:
        probs[f"vLLM {DTYPE_NAMES[dtype]}"] = run_vllm([prompts], True, model_dir, dtype)["probabilities"]
    if w8a8_dir is not None and w8a8_dir.exists():
        probs[W8A8_LABEL.replace(" prefix on", "")] = run_vllm([prompts], True, w8a8_dir, W8A8_DTYPE)["probabilities"]
    return {name: measures(ps, probs["Prism fp32"], options, labels) for name, ps in probs.items()}


def accuracy_rows(accuracy: dict[str, dict[str, float]]) -> list[str]:
    """(e)'s table: header and one row per engine."""
    return ["| engine | decisions | accuracy | agreement with fp32 | mean err | max err |", "|---|---|---|---|---|---|"] + [
        f"| {name} | {r['decisions']} | {r['accuracy']:.3f} | {r['agreement']:.3f} | {r['mean_err']:.4f} | "
        f"{r['max_err']:.4f} |" for name, r in accuracy.items()]


def alternation_row(workload: str, label: str, rounds: dict[str, list[float]], ratio: float) -> str:
    """One peers_alternately pairing as a table row: medians in ms, the ratio and the rounds' spread."""
    pairs = sorted(x / y for x, y in zip(rounds["peer"], rounds["prism"]))
    return (f"| {workload} | {label} | {1000 * statistics.median(rounds['prism']):.0f} | "
            f"{1000 * statistics.median(rounds['peer']):.0f} | {ratio:.2f}x | {pairs[0]:.2f}-{pairs[-1]:.2f}x |")


def pairing_section(rounds: dict[str, dict[str, dict]], peer: str, heading: str, intro: str,
                    prism_name: str) -> tuple[list[str], dict[str, float]]:
    """A report section on one of Prism's other plans against one peer, alternately (peers_alternately's
    rounds, workload -> {peer: {"prism": seconds, "peer": seconds}}) -> (its lines, workload -> the ratio
    of the medians, peer / Prism); nothing where the pairing did not run."""
    over = {w: statistics.median(row[peer]["peer"]) / statistics.median(row[peer]["prism"])
            for w, row in rounds.items() if peer in row}
    if not over:
        return [], {}
    lines = ["", f"## {heading}", "", intro, "",
             f"| workload | peer | {prism_name} ms | peer ms | peer / Prism | spread |", "|---|---|---|---|---|---|"]
    lines += [alternation_row(w, peer, rounds[w][peer], ratio) for w, ratio in over.items()]
    return lines, over


def same_width_section(same_width: dict[str, dict[str, dict]]) -> tuple[list[str], dict[str, float]]:
    """The report's section on Prism's 8-bit rung against vLLM's W8A8 checkpoint (pairing_section)."""
    return pairing_section(
        same_width, W8A8_LABEL, "At W8A8's own bit width, alternately",
        "The default keeps qkv and down_proj in 13 bits for its accuracy (docs/eval.md); vLLM's W8A8 "
        "checkpoint has every projection in 8 bits. The same pairing with Prism's 8-bit rung "
        "(`keep_exact=''`, every projection 8-bit) in place of the default, its error on the eval subset "
        "in (e) beside the checkpoint's.", "Prism 8-bit rung")


def amx_plan_section(amx_plan: dict[str, dict[str, dict]]) -> tuple[list[str], dict[str, float]]:
    """The report's section on the AMX plan (`keep_exact=AMX_PLAN`) against vLLM bf16 with prefix
    caching (pairing_section); only run on CPUs with AMX tiles, the only ones where it is faster."""
    return pairing_section(
        amx_plan, VLLM_BF16_LABEL, "The AMX plan against vLLM bf16, alternately",
        f"On AMX tiles down_proj's 13-bit product is four 8-bit tile products; `keep_exact={AMX_PLAN}` serves "
        "its 13-bit weights with 8-bit activations, two tile products (full eval: agreement 0.995, mean / max "
        "error 0.0150 / 0.0732, inside bf16's envelope overall; docs/eval.md). Not the default: on VNNI and "
        "AVX2 CPUs it costs accuracy for no speed. Its error on the eval subset is in (e).", "Prism AMX plan")


def write_report(args, workloads, times, memory, throughput_rows, concurrency, peaks, fractions, reps,
                 forest_tokens: int, startup: dict[str, float], accuracy: dict[str, dict[str, float]],
                 overhead: dict[str, dict[str, list[float]]], versus: dict[str, dict[str, dict]],
                 idle_cpu: dict[str, float], same_width: dict[str, dict[str, dict]] | None = None,
                 amx_plan: dict[str, dict[str, dict]] | None = None, dtype: str = "bfloat16") -> None:
    """versus: peers_alternately against the default; same_width: against the 8-bit rung (the W8A8
    checkpoint only; empty where there is none); amx_plan: the AMX plan against vLLM bf16 (AMX CPUs
    only); dtype: vLLM's (fastest_dtype), the one its targets read."""
    base = "prism engine int8"
    forced = getattr(args, "force_avx2", False)
    report_file = "side_by_side-forced-avx2.md" if forced else "side_by_side.md"
    plot_file = "speedup_vs_shared-forced-avx2.png" if forced else "speedup_vs_shared.png"
    med = {w: {e: 1000 * statistics.median(t) for e, t in row.items()} for w, row in times.items()}
    lines = ["# Side by side: Prism vs vLLM vs Hugging Face", "", f"CPU kind: {machine()}, {time.strftime('%Y-%m-%d')}.", "",
             f"`{' '.join(['.venv/bin/python', 'bench/side_by_side.py'] + sys.argv[1:])}` on "
             f"{THREADS} thread(s), CPU(s) {CPUS} for every engine; SmolLM2-135M-Instruct; median of {reps} runs, each on a ticket no "
             "engine had seen (spread = min-max); ratio = engine time / Prism engine int8 time (> 1: Prism is "
             f"faster). vLLM in {DTYPE_NAMES[dtype]}, its fastest dtype on this CPU (`vllm_driver.fastest_dtype`: "
             "bf16 where the CPU has bf16 dot products, fp32 where vLLM's bf16 is emulated).", ""]
    if forced:
        lines += ["**A stand-in for the AVX2 kind, not that kind**: this AVX-512 machine forced onto the AVX2 path "
                  "for every engine (bench/forced_avx2.py: " + ", ".join(f"`{k}={v}`" for k, v in
                                                                          forced_avx2.STANDIN_ENVIRONMENT.items()) +
                  ", torch's CPU probes answering as an AVX2 CPU's for vLLM, which then loads its AVX2 library; "
                  "llama.cpp built without AVX-512). Its cores run AVX2 code at their own rates, so these ratios "
                  "estimate the AVX2 kind's; the targets read are the AVX2 kind's.", ""]
    lines += ["| workload | engine | ms (median) | spread ms | ratio |", "|---|---|---|---|---|"]
    for w in workloads:
        for e, t in times[w].items():
            ms = [1000 * x for x in t]
            lines.append(f"| {w} | {e} | {med[w][e]:.0f} | {min(ms):.0f}-{max(ms):.0f} | "
                         f"{med[w][e] / med[w][base]:.2f}x |")
    lines += ["", "## (d) Throughput, requests/s (a request = a new ticket with 3 questions)", "",
              "Requests per level: " + ", ".join(f"{throughput_requests(c)} at concurrency {c}" for c in concurrency) + ".",
              "",
              "| server | " + " | ".join(f"concurrency {c}" for c in concurrency) + " |",
              "|---|" + "---|" * len(concurrency)]
    for label, row in throughput_rows.items():
        lines.append(f"| {label} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    if idle_cpu:
        lines += ["", "Prism's int8 server and vLLM's measured level by level in turn (both up, the idle one waiting "
                  f"on its sockets, {SETTLE_S:.0f} s between runs); CPU seconds the idle one used meanwhile: " +
                  ", ".join(f"{k} {v:.2f} s" for k, v in idle_cpu.items()) + "."]
    lines += ["", "## Through tritonserver against the engine, alternately", "",
              f"The int8 default, prefix cache off, {reps} rounds per workload, each one new batch through the "
              "server (HTTP, the batch's requests sent together) and one through the engine in this process, "
              "the order swapped every round (`alternate`): the overhead target reads these, not the phases "
              "above, which ran minutes apart. Medians; spread = the rounds' server / engine.", "",
              "| workload | engine ms | server ms | server / engine | spread |", "|---|---|---|---|---|"]
    server_over_engine = {w: statistics.median(t["server"]) / statistics.median(t["engine"]) for w, t in overhead.items()}
    for w, t in overhead.items():
        pairs = sorted(s / e for s, e in zip(t["server"], t["engine"]))
        lines.append(f"| {w} | {1000 * statistics.median(t['engine']):.0f} | {1000 * statistics.median(t['server']):.0f} | "
                     f"{server_over_engine[w]:.3f}x | {pairs[0]:.2f}-{pairs[-1]:.2f}x |")
    lines += ["", "## Prism against each peer, alternately", "",
              f"Prism's int8 engine (in this process, prefix cache off) and one peer's driver session (its engine "
              f"kept up, stopped between its calls), {reps} rounds per workload, each one new ticket through each, "
              "the order swapped every round (`peers_alternately`); the peer's time is its driver's, around its "
              "engine's work, as in its phase above. The ratio targets read these. Medians; spread = the rounds' "
              "peer / Prism.", "",
              "| workload | peer | Prism ms | peer ms | peer / Prism | spread |", "|---|---|---|---|---|---|"]
    peer_over_prism = {w: {label: statistics.median(t["peer"]) / statistics.median(t["prism"]) for label, t in row.items()}
                       for w, row in versus.items()}
    for w, row in versus.items():
        lines += [alternation_row(w, label, t, peer_over_prism[w][label]) for label, t in row.items()]
    same_width_lines, rung_over = same_width_section(same_width or {})
    lines += same_width_lines
    amx_plan_lines, amx_plan_over = amx_plan_section(amx_plan or {})
    lines += amx_plan_lines
    lines += ["", f"## (e) Probability error on the eval subset (the first {args.eval_limit} documents of each set; "
              "the same prompt tokens for every engine)", "",
              "Against Prism fp32 (the reference): err = max over a decision's options of |p - p_fp32|.", ""]
    lines += accuracy_rows(accuracy)
    lines += ["", "## Memory (GiB resident)", "", "| engine | GiB |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in memory.items()]
    lines += ["", "## Server startup to ready (s)", "", "| server | s |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in startup.items()]

    a = next(w for w in workloads if w.startswith("a"))
    b = next(w for w in workloads if w.startswith("b"))
    spec = json.loads((Path(args.model_dir) / "config.json").read_text())
    h, inter, layers = spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"]
    kv = h // spec["num_attention_heads"] * spec["num_key_value_heads"]
    params = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter)  # projections only
    useful = 2 * params * forest_tokens / (med[a][base] / 1000) / 1e9
    lines += ["", "## Roofline (workload a)", "",
              f"Matmul peaks measured here with torch: int8 `_int_mm` {peaks['int8']:.0f} GOPS, bf16 "
              f"{peaks['bf16']:.0f} GFLOPS, fp32 {peaks['fp32']:.0f} GFLOPS. Prism int8 on (a): "
              f"{forest_tokens} tokens x {2 * params / 1e9:.2f} GOP of projections per token in {med[a][base]:.0f} ms "
              f"= {useful:.0f} useful GOPS = {100 * useful / peaks['int8']:.0f}% of the int8 peak, "
              f"{100 * useful / peaks['fp32']:.0f}% of the fp32 peak, for the whole forward (attention and the "
              f"rest included). The default (`keep_exact={EngineConfig.keep_exact}`) runs the other projections "
              f"as exact products of 8-bit integers (the 8-bit VNNI kernel where the CPU has it) and those in "
              f"the exact 13-bit scheme; model/exact_matmul.py picks the fastest exact route."]
    if EIGHT_BIT_LABEL in med[a]:  # the target's "today 31% for the 8-bit rung" is this plan's share
        rung = 2 * params * forest_tokens / (med[a][EIGHT_BIT_LABEL] / 1000) / 1e9
        lines.append(f"The 8-bit rung (`keep_exact=''`: every projection 8-bit, not the default for its error, "
                     f"docs/results.md): {med[a][EIGHT_BIT_LABEL]:.0f} ms on (a) = {rung:.0f} useful GOPS = "
                     f"{100 * rung / peaks['int8']:.0f}% of the int8 peak.")
    if EXACT_LABEL in med[a]:
        exact = 2 * params * forest_tokens / (med[a][EXACT_LABEL] / 1000) / 1e9
        lines.append(f"The exact precision (13-bit integers, the int16 kernel): {med[a][EXACT_LABEL]:.0f} "
                     f"ms on (a) = {exact:.0f} useful GOPS = {100 * exact / peaks['int8']:.0f}% of the int8 peak.")
    # The speed issue's targets (#29): ratios = the engine's time / Prism's default's time.
    targets = [("(a) vs Prism fp32", med[a]["prism engine fp32"] / med[a][base], 2.0),
               ("(b) vs Prism fp32", med[b]["prism engine fp32"] / med[b][base], 2.0)]
    goal_a, goal_b = (1.5, 1.2) if has_avx512_vnni() and not forced else (1.3, 1.15)  # the targets per kind
    peer_goals = [(w, vllm_label(dtype), "vLLM prefix caching on", goal) for w, goal in ((a, goal_a), (b, goal_b))]
    peer_goals += [(a, vllm_label(dtype, False), "vLLM prefix caching off", 4.0)]
    peer_goals += [(w, W8A8_LABEL, "vLLM W8A8 prefix caching on", 1.0) for w in (a, b)]
    peer_goals += [(w, LLAMA_LABEL, "llama.cpp Q8_0", 2.0) for w in (a, b)]
    for w, label, name, goal in peer_goals:  # alternately where measured so (above), else the phases
        if label in peer_over_prism.get(w, {}):
            targets.append((f"({w[0]}) vs {name} (alternately)", peer_over_prism[w][label], goal))
        elif label in med[w]:
            targets.append((f"({w[0]}) vs {name} (phases)", med[w][label] / med[w][base], goal))
    for w, ratio in rung_over.items():  # beside the targets, not one of them: the default is what they ask of
        targets.append((f"({w[0]}) vs vLLM W8A8 at its bit width: Prism's 8-bit rung (alternately; not the default)",
                        ratio, 1.0))
    for w, ratio in amx_plan_over.items():
        targets.append((f"({w[0]}) vs vLLM prefix caching on: the AMX plan `{AMX_PLAN}` (alternately; not the default)",
                        ratio, 1.5 if w == a else 1.2))
    vllm_rps = throughput_rows.get(vllm_server_label(dtype))
    if vllm_rps and "prism triton int8" in throughput_rows:
        for c, prism, vllm in zip(concurrency, throughput_rows["prism triton int8"], vllm_rps):
            targets.append((f"requests/s at concurrency {c} vs vLLM server", prism / vllm, 1.5))
    lines += ["", "## Against the targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
    for name, got, goal in targets:
        lines.append(f"| {name} | {got:.2f}x | >= {goal}x | {'yes' if got >= goal else 'no'} |")
    shares = {"default": useful / peaks["int8"]}  # the whole forward on (a), of the int8 peak (Roofline)
    if EIGHT_BIT_LABEL in med[a]:
        shares["8-bit rung"] = rung / peaks["int8"]
    lines.append("| whole forward on (a), share of the int8 peak: " + " / ".join(shares) + " | " +
                 " / ".join(f"{100 * v:.0f}%" for v in shares.values()) + " | >= 55% | " +
                 " / ".join("yes" if v >= 0.55 else "no" for v in shares.values()) + " |")
    if overhead:  # measured alternately (above): (a), (b) and the (c) sweep
        overheads = {w: ratio - 1 for w, ratio in server_over_engine.items()}
        worst = max(overheads, key=overheads.get)
        sweep = max((v for w, v in overheads.items() if w not in (a, b)), default=float("nan"))
        lines.append(f"| Triton server overhead (alternately), (a) / (b) / worst of (c) | {100 * overheads[a]:.0f}% / "
                     f"{100 * overheads[b]:.0f}% / {100 * sweep:.0f}% (worst: {worst}) | < 10% each | "
                     f"{'yes' if max(overheads.values()) < 0.1 else 'no'} |")
    server_mem = [v for k, v in memory.items() if k.startswith("prism triton int8")]
    vllm_mem = [v for k, v in memory.items() if k.startswith("vLLM server")]
    if server_mem and vllm_mem:
        ratio = server_mem[0] / vllm_mem[0]
        lines.append(f"| serving memory vs vLLM | {ratio:.2f} of vLLM's | <= 0.25 | {'yes' if ratio <= 0.25 else 'no'} |")
    if server_mem:
        lines.append(f"| one replica's server tree | {server_mem[0]:.2f} GiB | <= 1.2 GiB | "
                     f"{'yes' if server_mem[0] <= 1.2 else 'no'} |")

    plot_fractions = [w for w in workloads if w.startswith("c")]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for e in times[plot_fractions[0]]:
            if e == base:
                continue
            ax.plot([100 * f for f in fractions], [med[w][e] / med[w][base] for w in plot_fractions], marker="o", label=e)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("shared fraction of the material (%)")
        ax.set_ylabel("engine time / Prism int8 time")
        ax.set_title("Prism int8 speedup vs shared fraction (3 questions)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(RESULTS / plot_file, dpi=110)
        lines += ["", f"![speedup vs shared fraction]({plot_file})"]
    except ImportError:
        lines += ["", "(matplotlib is not installed: no plot; `make bench` installs it)"]
    write_result(report_file, lines)


if __name__ == "__main__":
    main()
