"""The package layout is the architecture: imports inside prism_backend point down the layers only,
and no module imports itself back through another (lazy imports inside functions included).

    serving  ->  engine  ->  text  ->  model  ->  kernels (cpu/, triton/)
    (config, errors, forest, prefix_cache, paths, processes, reproducibility at the top of
    prism_backend: importable by all)

Around the engine: prism_launcher (`prism`, the server launcher and operations) may import the
engine and the client; prism_client (the client library) imports neither the engine nor torch nor
the launcher, so `prism health` and `prism decide` run without them; the engine imports nothing of
the launcher and, of the client, only a leaf module that needs numpy alone (the bits' digest).

kernels/ imports nothing of Prism's, kernels/cpu/ nothing of kernels/triton/ (importing the CPU
kernels must never define a Triton-lang kernel: TRITON_INTERPRET is read then), and the packages'
__init__ files import nothing.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "prism_backend"
CLIENT = ROOT / "prism_client"
LAUNCHER = ROOT / "prism_launcher"
# Higher layers may import lower ones; the shared top-level modules import only each other.
LAYERS = {"": 0, "model": 1, "text": 2, "engine": 3, "serving": 4}
KERNELS_USERS = {"model"}  # Prism's kernels (CPU and Triton-lang) are the model's business alone
# Besides the standard library and itself, the client imports only these (tritonclient, lazily).
CLIENT_DEPENDENCIES = {"numpy", "tritonclient"}
# What the engine may import of the client: leaf modules of the standard library and numpy alone
# (an exported repository carries prism_client for them: prism_launcher/export.py).
ENGINE_FROM_CLIENT = {"prism_client.determinism"}
# Loaded by importing the engine: none may be in a process that ran only client commands.
ENGINE_SIDE = ("torch", "transformers", "prism_backend", "kernels")


KERNELS = ROOT / "kernels"


def module_name(path: Path) -> str:
    """prism_backend/model/quant.py -> prism_backend.model.quant, kernels/cpu/__init__.py -> kernels.cpu."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, lazy: bool = True) -> set[str]:
    """Every module `path` imports, at any depth of the file (lazy imports count), or with
    lazy=False only at the top of the module (what importing it runs)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree) if lazy else tree.body:
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
        assert not any(m.startswith(("prism_backend", "prism_client", "prism_launcher")) for m in imports_of(path)), path


def test_cpu_kernels_import_no_triton_lang_kernel():
    for path in sorted((KERNELS / "cpu").rglob("*.py")):
        imported = imports_of(path)
        assert not any(m == "triton" or m.startswith(("triton.", "kernels.triton")) for m in imported), path


def test_kernel_package_inits_import_nothing():
    """`import kernels.cpu.exact_gemm` runs kernels/__init__.py and kernels/cpu/__init__.py: were they to
    import a kernels.triton module, it would bind its kernels before conftest sets TRITON_INTERPRET."""
    for path in sorted(KERNELS.rglob("__init__.py")):
        assert not imports_of(path), path


def top(module: str) -> str:
    return module.split(".")[0]


def test_client_imports_neither_engine_nor_launcher():
    """Not torch, prism_backend, kernels or prism_launcher, nor anything but the standard library,
    numpy and tritonclient, at any depth of any of its modules."""
    allowed = set(sys.stdlib_module_names) | CLIENT_DEPENDENCIES | {"prism_client"}
    found = [f"{module_name(path)} imports {target}"
             for path in sorted(CLIENT.rglob("*.py")) for target in imports_of(path) if top(target) not in allowed]
    assert not found, "\n".join(sorted(found))


def test_engine_imports_only_leaf_modules_of_the_client_and_nothing_of_the_launcher():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for target in imports_of(path):
            if top(target) == "prism_launcher" or (
                    top(target) == "prism_client"
                    and not any(target == m or target.startswith(m + ".") for m in ENGINE_FROM_CLIENT)):
                found.append(f"{module_name(path)} imports {target}")
    for module in sorted(ENGINE_FROM_CLIENT):
        path = ROOT / (module.replace(".", "/") + ".py")
        found += [f"{module} (imported by the engine) imports {target}" for target in imports_of(path)
                  if top(target) not in set(sys.stdlib_module_names) | {"numpy"}]
    assert not found, "\n".join(sorted(found))


def test_launcher_cli_imports_the_engine_lazily():
    """Importing prism_launcher.cli (the `prism` console script) loads only the client's side: the
    launcher's modules and the engine are imported inside the commands that need them."""
    found = [target for target in imports_of(LAUNCHER / "cli.py", lazy=False)
             if top(target) not in set(sys.stdlib_module_names) | {"prism_client"}]
    assert not found, found


def python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


LOADED_ENGINE_SIDE = f"sorted(m for m in sys.modules if m.split('.')[0] in {ENGINE_SIDE!r})"


def test_client_modules_load_without_torch():
    done = python("-c", "import sys\n"
                        "import prism_client, prism_client.client, prism_client.cli, prism_client.determinism, "
                        "prism_client.determinism_check\n"
                        f"print({LOADED_ENGINE_SIDE})")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the client loaded the engine's side: {done.stdout}"


def test_prism_health_runs_without_torch():
    """`prism health` (the Kubernetes probe) as the console script runs it, prism_launcher.cli:main,
    against a closed port: it reports unhealthy, with neither torch nor the engine loaded."""
    done = python("-c", "import sys\n"
                        "from prism_launcher.cli import main\n"
                        f"code = main(['health', '--url', '127.0.0.1:{free_port()}', '--timeout', '10'])\n"
                        f"print(code, {LOADED_ENGINE_SIDE}, sorted(m for m in sys.modules if m.startswith('prism_launcher')))")
    assert done.stdout == "1 [] ['prism_launcher', 'prism_launcher.cli']\n", done.stdout + done.stderr
    assert "unhealthy" in done.stderr


def test_python_m_prism_client_health_runs_without_torch():
    """The client's commands alone: `python -m prism_client health`, every import it makes listed."""
    done = python("-X", "importtime", "-m", "prism_client", "health", "--url", f"127.0.0.1:{free_port()}",
                  "--timeout", "10")
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "prism_client.client" in imported, done.stderr[-2000:]
    assert not {m for m in imported if top(m) in ENGINE_SIDE + ("prism_launcher",)}, sorted(imported)
    assert done.returncode == 1 and "unhealthy" in done.stderr


def test_prism_console_script_is_the_launcher_cli():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"prism": "prism_launcher.cli:main"}


def test_tokenizer_and_postprocess_stubs_run_without_torch(model_dir):
    """The prism_tokenizer and prism_postprocess Triton models, imported and run as their stubs run
    them (pb_utils replaced by an empty module: only execute() touches it), tokenize a request and
    post-process its decisions without loading torch, the engine, the model layer or the kernels:
    each stub then holds ~100 MiB instead of ~450 MiB."""
    done = python("-c", f"""
import importlib.util, json, sys, types
import numpy as np
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")

def load(name):
    spec = importlib.util.spec_from_file_location(name, "model_repository/" + name + "/1/model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel()

tokenizer, post = load("prism_tokenizer"), load("prism_postprocess")
tokenizer.initialize({{"model_config": json.dumps({{"parameters": {{"model_dir": {{"string_value": {str(model_dir)!r}}}}}}}), "model_repository": "model_repository/prism_tokenizer",
                      "model_version": "1"}})
out = tokenizer.step.run(np.array([b"I was charged twice this month."], dtype=object),
                         np.array([b"team", b"severity"], dtype=object), None)
n = int(out["candidate_counts"].sum())
out["probabilities"] = np.full((1, n), 1.0 / n, np.float32)
out["scoring_paths"] = np.array([[b"candidates", b"candidates"]], dtype=object)
from prism_backend.serving.steps import postprocess
print(len(postprocess(out)))
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "kernels")
             or m.startswith(("prism_backend.engine", "prism_backend.model.loader", "transformers.modeling_utils"))))
""")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["2", "[]"], done.stdout


def test_nothing_edits_sys_path():
    """Scripts and tests import Prism, the eval (an installed package) and their own folder's modules
    by name; no file puts a folder on sys.path. bench/tree_time.py alone does, on purpose: it loads
    the modules of another checkout given on its command line."""
    on_purpose = {ROOT / "bench" / "tree_time.py"}
    folders = ("prism_backend", "prism_client", "prism_launcher", "kernels", "bench", "evals", "tests",
               "model_repository", "perf_analyzer_configs")
    paths = sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))
    assert ROOT / "bench" / "run_perf.py" in paths and on_purpose <= set(paths)
    editing = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("insert", "append", "extend") and ast.unparse(node.func.value) == "sys.path"):
                editing.append(path)
    assert sorted(set(editing) - on_purpose) == [], "sys.path edited"
    assert set(editing) >= on_purpose, "the check no longer sees tree_time.py's edit"
