"""The source tree keeps its shape: ruff-clean, one MPI module, small modules, one package per concern."""

import ast
import subprocess
import sys
from pathlib import Path

from support import ROOT

SRC = ROOT / "src" / "hpcpipe"
# the top level: small shared modules and the command entry points; everything else lives in a package
TOP_LEVEL = {"__init__", "errors", "config", "config_checks", "config_toml", "trace", "cli", "h5files", "checkpoint",
             "evaluate", "simulate", "generate", "lazy_h5py"}
PACKAGES = {"schedule", "nn", "kernels", "runtime", "state", "profiles", "hf", "train", "infer", "serve", "plan"}


def _modules():
    return sorted(p for p in SRC.rglob("*.py"))


def test_ruff_check_is_clean():
    # the rules are pyproject.toml's [tool.ruff]; `pip install ".[test]"` brings ruff
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_exactly_one_module_imports_mpi4py_at_module_level():
    importers = []
    for path in _modules():
        for node in ast.parse(path.read_text()).body:      # module level only, not inside functions
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "mpi4py" or n.startswith("mpi4py.") for n in names):
                importers.append(str(path.relative_to(SRC)))
    assert importers == ["runtime/comm.py"]


def test_no_module_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in _modules() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def _imports(path: Path, package: str) -> set[str]:
    """hpcpipe modules a module imports anywhere (function bodies included), except under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {name for name in found if name.startswith("hpcpipe")}


def _import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in _modules():
        name = ".".join(("hpcpipe",) + path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for target in _imports(path, package):
            while target and target not in modules:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            # a package's __init__ imported by its own modules is no circle
            if target and target != name and not name.startswith(target + "."):
                targets.add(target)
        graph[name] = targets
    return graph


def test_no_import_circles():
    graph = _import_graph()
    state: dict[str, int] = {}     # 1 on the current path, 2 done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert circles == []


def test_the_planner_is_on_top_and_profiles_are_read_below_it():
    # training, inference and serving read profiles (hpcpipe.profiles) and never reach the planner, which measures
    graph = _import_graph()
    for name, targets in graph.items():
        if not name.startswith("hpcpipe.plan"):
            assert not any(t.startswith("hpcpipe.plan") for t in targets), f"{name} imports {targets}"
        if name.startswith("hpcpipe.profiles"):
            assert not any(t.startswith(("hpcpipe.train", "hpcpipe.infer", "hpcpipe.serve")) for t in targets), name


def test_runtime_is_below_state():
    # runtime (MPI, topology, signals, bookkeeping files) serves state, never the other way round
    graph = _import_graph()
    for name, targets in graph.items():
        if name.startswith("hpcpipe.runtime"):
            assert not any(t.startswith("hpcpipe.state") for t in targets), f"{name} imports {targets}"


def test_the_tokenizers_package_is_reached_only_from_hf():
    # a Hugging Face tokenizer lives in hf/ (hf/tokenizer.py); what is stored with the weights, and the bytes and
    # chars kinds, in state/tokenizer.py, which hands kind hf to hf/
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n == "tokenizers" or n.startswith("tokenizers.") for n in names):
                assert path.parent.name == "hf", f"{path.relative_to(SRC)} imports the tokenizers package"


def test_top_level_holds_only_shared_modules_and_commands():
    top = {p.stem for p in SRC.glob("*.py")}
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top == TOP_LEVEL and packages == PACKAGES


def test_no_package_module_is_named_like_a_top_level_command():
    # `python -m hpcpipe.simulate` is hpcpipe/simulate.py: a package module called simulate (or checkpoint_dir,
    # generate_command) left a reader guessing which of the two is the command
    commands = {"checkpoint", "evaluate", "generate", "simulate"}
    alike = [str(p.relative_to(SRC)) for p in _modules() if p.parent != SRC
             and any(p.stem == c or p.stem.startswith(f"{c}_") for c in commands)]
    assert commands <= TOP_LEVEL and alike == []


def test_schedules_and_models_import_no_mpi_and_no_runtime():
    # schedules are pure data and layers pure compute: neither may reach MPI, even indirectly through runtime/
    for package in ("schedule", "nn"):
        for path in (SRC / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    assert not node.module.startswith(("mpi4py", "hpcpipe.runtime", "hpcpipe.train",
                                                       "hpcpipe.infer", "hpcpipe.state")), \
                        f"{path.relative_to(SRC)} imports {node.module}"


def test_serving_front_end_reaches_no_mpi():
    # the HTTP thread of rank 0 must never make an MPI call: its modules import neither mpi4py nor the runtime
    for name in ("broker", "completion", "http_api", "metrics", "openai_schema", "chat_schema", "responses",
                 "textstream"):
        path = SRC / "serve" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for m in modules:
                assert not m.startswith(("mpi4py", "hpcpipe.runtime")), f"serve/{name}.py imports {m}"


KIND_PACKAGES = sorted(p.parent.name for p in (SRC / "nn").glob("*/__init__.py") if p.parent.name != "core")


def test_model_kinds_are_folders_reached_only_through_the_registry():
    # adding a kind is its folder and one registry line: outside the kinds' folders only the registry imports
    # them (a kind may build on another kind's modules: moe on llama), and neither a kind nor the shared core
    # imports the config (the config is built from the kinds)
    assert {"mlp", "gpt", "llama", "moe"} <= set(KIND_PACKAGES)
    graph = _import_graph()
    kinds = tuple(f"hpcpipe.nn.{k}" for k in KIND_PACKAGES)
    for name, targets in graph.items():
        in_kind = any(name == k or name.startswith(k + ".") for k in kinds)
        foreign = {t for t in targets if t.startswith(kinds)}
        if name != "hpcpipe.nn.registry" and not in_kind:
            assert not foreign, f"{name} imports {sorted(foreign)}: only hpcpipe.nn.registry reaches the kinds"
        if in_kind or name.startswith("hpcpipe.nn.core"):
            assert not {t for t in targets if t.startswith(("hpcpipe.config", "hpcpipe.config_checks"))}, name
