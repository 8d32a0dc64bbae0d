"""The package's shape, checked from its source with ``ast`` (no imports, no third-party tool).

- No import cycle inside ``lightning_zeroq``: every ``import`` counts, wherever it stands (module
  level, inside a function, under ``if TYPE_CHECKING:``), because a cycle hidden behind a lazy or
  type-only import is still two files that cannot be read one after the other.
- No private name (``_x``) is imported from another file of the package.
- Concepts, not lines: ``ZeroEngine`` is a facade of a few attributes that hands itself to no part;
  each part that calls the offload placement is typed with the one role it uses (``offload/roles.py``);
  the roles and the stores files hold one kind of thing each; only the checkpoint door and the store
  name the checkpoint kinds; the integrations (``lightning``, ``fabric``) reach ``checkpoint/`` only through
  its door (``checkpoint/api.py``, the names of its ``__all__``).
- The engine never imports Lightning or Hydra, so plain PyTorch, Fabric and tests can drive it.
- The engine reads its settings from policies (``zero/policies.py``), never from ``ZeroConfig``: only
  that module reads the config's fields.
- Layers (``LAYERS``): the library (``zero``, ``swap``, ``ops``, ``checkpoint``, ``config``, ``validation``, ``ranks``,
  ``nulls``) imports neither the integrations nor the CLI, nor Lightning or Hydra; the integrations (``lightning``,
  ``fabric`` and their ``common`` part) never import the CLI, and neither of the two imports the other.
  Every module of the package belongs to a layer; ``planning`` sits between the library and the integrations.
- Rooms (``ROOMS``): ``zero/optim/``, ``zero/offload/``, ``zero/memory/``, ``planning/`` from the floor up; no
  module imports a room above its own, and nothing under ``zero/`` imports ``planning/``.
- ``zero/offload/`` holds placements only (``OFFLOAD_KINDS``): placements, the shard stores, the roles, the
  factories and the host placement's parts; byte counts live in ``zero/memory/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_zeroq"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if ".venv" not in p.parts}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported module of the package, names taken from it) for every import statement in ``path``."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names if alias.name.startswith("lightning_zeroq")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("lightning_zeroq"):
                continue
            for alias in node.names:  # "from pkg import submodule" imports the submodule
                sub = f"{target}.{alias.name}"
                out.append((sub, []) if sub in modules else (target, [alias.name]))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, _ in _imports(path, name, modules):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name and target in modules:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_the_package():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (every import counts, TYPE_CHECKING ones too): {cycles}"


def test_no_private_name_is_imported_from_another_file():
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        for target, names in _imports(path, name, modules):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                offenders.append(f"{name} imports {private} from {target}")
    assert not offenders, offenders


def _tree(relative: str) -> ast.Module:
    return ast.parse((PACKAGE / relative).read_text(encoding="utf-8"))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _instance_attributes(cls: ast.ClassDef) -> set[str]:
    """Every ``self.<name> = ...`` (or ``+=``, annotated) in the class's methods."""
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


ENGINE_MAX_ATTRIBUTES = 12


def test_the_engine_is_a_facade_of_few_attributes():
    # ZeroEngine keeps its public API over what ``build.py`` made (``parts``) and the ``step.Stepper``:
    # a new feature lands in a part, not as one more attribute of the hub.
    attributes = _instance_attributes(_class(_tree("zero/engine.py"), "ZeroEngine"))
    assert len(attributes) <= ENGINE_MAX_ATTRIBUTES, sorted(attributes)
    assert {"parts", "stepper"} <= attributes


def test_the_attribute_counter_counts():
    tree = ast.parse("class A:\n def f(self):\n  self.a = 1\n  self.b: int = 2\n  self.a += 1\n  x = self.c\n")
    assert _instance_attributes(_class(tree, "A")) == {"a", "b"}


def test_the_engine_hands_itself_to_no_part():
    # The facade passes its parts (``self.parts``), never ``self``: only the registry of live engines
    # (``owning_engine``) holds the engine itself.
    offenders = []
    for node in ast.walk(_class(_tree("zero/engine.py"), "ZeroEngine")):
        if isinstance(node, ast.Call):
            args = [*node.args, *(k.value for k in node.keywords)]
            if any(isinstance(a, ast.Name) and a.id == "self" for a in args) and ast.unparse(node.func) != "_ENGINES.add":
                offenders.append(f"engine.py:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


ROLE_TAKERS = {  # (file, function, parameter): the offload role it is typed with (offload/roles.py)
    ("zero/reducer.py", "__init__", "gradients"): "Gradients",
    ("zero/gather.py", "__init__", "masters"): "Masters",
    ("zero/wire.py", "sync", "placement"): "Masters",
    ("zero/wire.py", "encode", "placement"): "Masters",
    ("zero/step.py", "run", "placement"): "Updater",
    ("zero/step.py", "step_in", "placement"): "Updater",
    ("zero/step.py", "apply_multiplier", "placement"): "Updater",
}
WHOLE_PLACEMENT = frozenset({"zero/build.py", "zero/engine.py", "zero/step.py", "zero/state_dict.py"})
"""Who may hold the placement whole: the build, the facade, the stepper (its lifecycle: ``attach``,
``step_done``) and the state dict (``state_loaded``); and the offload package itself."""


def _annotations(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in [*node.args.args, *node.args.kwonlyargs]:
                if arg.annotation is not None:
                    yield node.name, arg.arg, ast.unparse(arg.annotation).strip("'\"")
        elif isinstance(node, ast.AnnAssign):
            yield "", ast.unparse(node.target), ast.unparse(node.annotation).strip("'\"")


def test_each_part_takes_only_the_offload_role_it_calls():
    # FSDP2 keeps the parameter, its group's collectives and its hooks apart; our placement plays three
    # roles, and each part that calls it is typed with the one role it uses (mypy then checks it calls
    # nothing else). Only the build, the facade, the stepper and the state dict hold it whole.
    found = {(f, fn, arg): ann for f, _, _ in ROLE_TAKERS for fn, arg, ann in _annotations(_tree(f))}
    wrong = {key: found.get(key) for key, role in ROLE_TAKERS.items() if found.get(key) != role}
    assert not wrong, wrong
    whole = []
    for path in sorted((PACKAGE / "zero").rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        if where in WHOLE_PLACEMENT or where.startswith("zero/offload/"):
            continue
        whole += [f"{where}: {fn}({arg}: {ann})" for fn, arg, ann in _annotations(ast.parse(path.read_text()))
                  if "OptimizerHome" in ann]
    assert not whole, whole


def test_the_roles_and_the_stores_have_one_job_each():
    # roles.py holds the role protocols only; stores.py holds shard stores only (each one the
    # ShardStore protocol's put / get / device_tensors / close).
    roles = [n for n in _tree("zero/offload/roles.py").body if isinstance(n, ast.ClassDef)]
    assert {n.name for n in roles} == {"Masters", "Gradients", "Updater"}
    assert all(any(ast.unparse(b) == "Protocol" for b in n.bases) for n in roles)
    stores = [n for n in _tree("zero/offload/stores.py").body if isinstance(n, ast.ClassDef)]
    for cls in stores:
        methods = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
        assert {"put", "get", "device_tensors", "close"} <= methods, (cls.name, methods)


def test_only_the_checkpoint_door_and_the_store_name_the_checkpoint_kinds():
    # What a path is (``store.Kind``) is decided in the store; the door (``checkpoint/api.py``) and everyone
    # else ask ``Located`` or go through the door.
    allowed = {"checkpoint/store.py", "checkpoint/api.py"}
    offenders = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                       if str(p.relative_to(PACKAGE)) not in allowed
                       and any(isinstance(n, ast.Name) and n.id == "Kind" for n in ast.walk(ast.parse(p.read_text()))))
    assert not offenders, offenders


def test_the_engine_imports_neither_lightning_nor_hydra():
    for path in (PACKAGE / "zero").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning", "hydra", "omegaconf")]
            assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


POLICY_BUILDER = PACKAGE / "zero" / "policies.py"
CONFIG_NAMES = ("config", "cfg", "zero_config")
"""What a ``ZeroConfig`` is called where it is passed around (and any parameter annotated ``ZeroConfig``)."""


def _config_members() -> set[str]:
    """Every field, property and method ``ZeroConfig`` defines, from ``config.py``'s source."""
    tree = ast.parse((PACKAGE / "config.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ZeroConfig")
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return names | {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("__")}


def _config_reads(source: str, members: set[str]) -> list[str]:
    """``config.stage``, ``self.config.stage``, ``getattr(config, ...)``: every read of a ``ZeroConfig``
    member from an expression that holds a config (by its name, or a parameter annotated ``ZeroConfig``)."""
    tree = ast.parse(source)
    holders = set(CONFIG_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None and "ZeroConfig" in ast.unparse(node.annotation):
            holders.add(node.arg)

    def holds_config(expr: ast.expr) -> bool:
        return (isinstance(expr, ast.Name) and expr.id in holders) or (
            isinstance(expr, ast.Attribute) and expr.attr in CONFIG_NAMES)

    reads = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in members and holds_config(node.value)) or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and node.args and holds_config(node.args[0])):
            reads.append((node.lineno, node.col_offset, f"line {node.lineno}: {ast.unparse(node)}"))
    return [read for *_, read in sorted(reads)]


def test_the_config_read_finder_finds_reads():
    members = _config_members()
    assert {"stage", "nvme_path", "uses_nvme"} <= members
    source = (
        "def f(c: ZeroConfig, config, policy):\n"
        "    a = c.stage + config.overlap_comm + self.config.nvme_path + getattr(config, 'x')\n"
        "    b = policy.stage + c.world_size + sharding.config\n"
    )
    assert [r.split(": ")[1] for r in _config_reads(source, members)] == [
        "c.stage", "config.overlap_comm", "self.config.nvme_path", "getattr(config, 'x')"]


def test_only_the_policy_builder_reads_the_config():
    members = _config_members()
    offenders = [
        f"{path.relative_to(PACKAGE)} {read}"
        for path in sorted((PACKAGE / "zero").rglob("*.py")) if path != POLICY_BUILDER
        for read in _config_reads(path.read_text(encoding="utf-8"), members)
    ]
    assert not offenders, (
        "the engine reads ZeroConfig outside zero/policies.py; add what it needs to a policy there: "
        f"{offenders}"
    )
# Each layer of the package: its top-level names under lightning_zeroq, and the layers it may import.
LAYERS = {
    "library": ({"zero", "swap", "ops", "checkpoint", "config", "validation", "ranks", "nulls", "_version"}, {"library"}),
    "planning": ({"planning"}, {"library", "planning"}),
    "common": ({"common"}, {"library", "planning", "common"}),
    "lightning": ({"lightning"}, {"library", "planning", "common", "lightning"}),
    "fabric": ({"fabric"}, {"library", "planning", "common", "fabric"}),
    "cli": ({"cli"}, {"library", "planning", "common", "lightning", "fabric", "cli"}),
}
# Imports across layers that are allowed, each with its reason.
ALLOWED: set[tuple[str, str]] = set()
THIRD_PARTY_FRONT_ENDS = ("lightning", "pytorch_lightning", "lightning_utilities", "hydra", "omegaconf")


def _layer(module: str) -> str | None:
    """The layer of ``lightning_zeroq.<top>...``; the package's ``__init__`` (the public API) is in none."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return next((name for name, (tops, _) in LAYERS.items() if parts[1] in tops), "unassigned")


def _layer_violations(graph: dict[str, set[str]], allowed: frozenset = frozenset(ALLOWED)) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        layer = _layer(module)
        if layer == "unassigned":
            found.append(f"{module} belongs to no layer; add its name to LAYERS")
            continue
        for target in sorted(targets):
            other = _layer(target)
            if (layer is not None and other is not None and other != "unassigned" and other not in LAYERS[layer][1]
                    and (module, target) not in allowed):
                found.append(f"{module} ({layer}) imports {target} ({other})")
    return found


def test_the_layer_check_finds_an_import_against_the_layers():
    graph = {"lightning_zeroq.zero.engine": {"lightning_zeroq.lightning.strategy"},
             "lightning_zeroq.fabric.strategy": {"lightning_zeroq.lightning.checkpoint", "lightning_zeroq.zero.engine"},
             "lightning_zeroq.common.strategy": {"lightning_zeroq.cli.train"},
             "lightning_zeroq.cli.train": {"lightning_zeroq.lightning.strategy", "lightning_zeroq.config"},
             "lightning_zeroq.helpers": set(), "lightning_zeroq": {"lightning_zeroq.cli.gpt"}}
    assert _layer_violations(graph, frozenset()) == [
        "lightning_zeroq.common.strategy (common) imports lightning_zeroq.cli.train (cli)",
        "lightning_zeroq.fabric.strategy (fabric) imports lightning_zeroq.lightning.checkpoint (lightning)",
        "lightning_zeroq.helpers belongs to no layer; add its name to LAYERS",
        "lightning_zeroq.zero.engine (library) imports lightning_zeroq.lightning.strategy (lightning)",
    ]


def test_each_layer_imports_only_the_layers_below_it():
    violations = _layer_violations(_graph())
    assert not violations, violations


def test_the_library_imports_neither_lightning_nor_hydra():
    offenders = []
    for name, path in sorted(_modules().items()):
        if _layer(name) != "library":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{name} imports {n}" for n in names if n.split(".")[0] in THIRD_PARTY_FRONT_ENDS]
    assert not offenders, offenders


ENGINE_VIEW = "lightning_zeroq.zero.state_dict"
ENGINE_INTERNALS = frozenset({"units", "placement", "segments", "segment_masters", "master", "shard_span", "param_span",
                              "resident", "state_loaded", "device_master", "swapper", "gatherer", "reducer"})


INTEGRATION_CHECKPOINTS = frozenset({"lightning_zeroq.lightning.checkpoint", "lightning_zeroq.fabric.checkpoint"})


def test_checkpoints_see_the_engine_only_through_its_sharded_view():
    # checkpoint/ (and the Trainer's and Fabric's checkpoint glue) imports nothing of zero/ but the view's
    # module, and reads no engine internals by name (units, placement, segments, swap keys): what it
    # knows of the engine's state, the view tells it.
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        if not (name.startswith("lightning_zeroq.checkpoint") or name in INTEGRATION_CHECKPOINTS):
            continue
        for target, _ in _imports(path, name, modules):
            if target.startswith("lightning_zeroq.zero") and target != ENGINE_VIEW:
                offenders.append(f"{name} imports {target}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
                offenders.append(f"{name}:{node.lineno} reads .{node.attr}")
    assert not offenders, offenders


CHECKPOINT_DOOR = "lightning_zeroq.checkpoint.api"
DOOR_USERS = ("lightning_zeroq.lightning", "lightning_zeroq.fabric", "lightning_zeroq.common")
"""The integrations whose checkpoint glue and strategies reach ``lightning_zeroq.checkpoint`` through its door only."""


def _door_surface() -> set[str]:
    """The names of the door's ``__all__``."""
    for node in _tree("checkpoint/api.py").body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _door_violations(name: str, tree: ast.Module, surface: set[str]) -> list[str]:
    """What module ``name`` (parsed: ``tree``) takes of ``lightning_zeroq.checkpoint`` other than through the door:
    an import of another of its modules, or a name of the door that its ``__all__`` does not hold."""
    found, doors = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == CHECKPOINT_DOOR and alias.asname:
                    doors.add(alias.asname)
                elif alias.name.startswith("lightning_zeroq.checkpoint"):
                    found.append(f"{name} imports {alias.name}: go through the door, {CHECKPOINT_DOOR}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_zeroq.checkpoint"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" == CHECKPOINT_DOOR:
                    doors.add(alias.asname or alias.name)
                elif node.module != CHECKPOINT_DOOR:
                    found.append(f"{name} imports {alias.name} from {node.module}: go through the door, {CHECKPOINT_DOOR}")
                elif alias.name not in surface:
                    found.append(f"{name} imports {alias.name} from the door, whose __all__ does not name it")
    found += [f"{name}:{node.lineno} reads {node.value.id}.{node.attr}, which the door's __all__ does not name"
              for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in doors and node.attr not in surface]
    return found


def test_the_door_check_finds_a_side_door():
    source = ("from lightning_zeroq.checkpoint import api, store\n"
              "from lightning_zeroq.checkpoint.api import save, torch_load\n"
              "import lightning_zeroq.checkpoint.agree as agree\n"
              "import lightning_zeroq.checkpoint.api as door\n"
              "api.load(door.save, api.atomic)\n")
    assert _door_violations("lightning_zeroq.lightning.glue", ast.parse(source), {"save", "load"}) == [
        ("lightning_zeroq.lightning.glue imports store from lightning_zeroq.checkpoint: go through the door, "
         "lightning_zeroq.checkpoint.api"),
        "lightning_zeroq.lightning.glue imports torch_load from the door, whose __all__ does not name it",
        ("lightning_zeroq.lightning.glue imports lightning_zeroq.checkpoint.agree: go through the door, "
         "lightning_zeroq.checkpoint.api"),
        "lightning_zeroq.lightning.glue:5 reads api.atomic, which the door's __all__ does not name",
    ]


def test_the_integrations_reach_the_checkpoints_only_through_the_door():
    # lightning/, fabric/ and common/ (the checkpoint glue and the strategies) import of lightning_zeroq.checkpoint only
    # checkpoint/api.py, and of it only what its __all__ names: the package's files can be rearranged behind it.
    surface = _door_surface()
    assert {"save", "load", "Checkpointer"} <= surface
    offenders = [found for name, path in sorted(_modules().items())
                 if any(name == user or name.startswith(user + ".") for user in DOOR_USERS)
                 for found in _door_violations(name, ast.parse(path.read_text(encoding="utf-8")), surface)]
    assert not offenders, offenders


def test_no_engine_part_depends_on_the_whole_engine():
    # Each module under zero/ takes the parts it uses (``build.Parts`` where several come together),
    # never ``ZeroEngine``: nothing under zero/ but the engine's facade (and the package's face,
    # ``zero/__init__.py``, which re-exports it) imports engine.py, so a part can be read, tested and
    # replaced alone.
    graph = _graph()
    engine = "lightning_zeroq.zero.engine"
    offenders = sorted(name for name, targets in graph.items()
                       if name.startswith("lightning_zeroq.zero") and name not in (engine, "lightning_zeroq.zero")
                       and engine in targets)
    assert engine in graph and not offenders, offenders


# ------------------------------------------------------------------ rooms: runtime, memory counts, planning

ROOMS = ("lightning_zeroq.zero.optim", "lightning_zeroq.zero.offload", "lightning_zeroq.zero.memory",
         "lightning_zeroq.planning")
"""Rooms from the floor up: ``torch.optim`` bound to shards, the placements (which step the optimizers), the
memory counts (which read the placements' arithmetic), planning (which reads them all). A module may import its
own room or one below it, never one above; the engine's other files (``zero/*.py``) sit between and around
them, kept acyclic by the cycle rule."""


def _room(module: str) -> int | None:
    return next((i for i, room in enumerate(ROOMS) if module == room or module.startswith(room + ".")), None)


def _upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        here = _room(module)
        for target in sorted(targets):
            there = _room(target)
            if here is not None and there is not None and there > here:
                found.append(f"{module} ({ROOMS[here]}) imports {target} ({ROOMS[there]}), a room above it")
    return found


def test_the_room_check_finds_an_upward_arrow():
    graph = {"lightning_zeroq.zero.optim.binding": {"lightning_zeroq.zero.offload.host", "lightning_zeroq.zero.unit"},
             "lightning_zeroq.zero.memory.host": {"lightning_zeroq.zero.offload.split"},
             "lightning_zeroq.zero.offload.split": {"lightning_zeroq.planning.choose"}}
    assert _upward_arrows(graph) == [
        "lightning_zeroq.zero.offload.split (lightning_zeroq.zero.offload) imports lightning_zeroq.planning.choose "
        "(lightning_zeroq.planning), a room above it",
        "lightning_zeroq.zero.optim.binding (lightning_zeroq.zero.optim) imports lightning_zeroq.zero.offload.host "
        "(lightning_zeroq.zero.offload), a room above it",
    ]


def test_no_room_imports_a_room_above_it():
    arrows = _upward_arrows(_graph())
    assert not arrows, arrows


def test_the_engine_never_imports_planning():
    # zero/ is what a step runs; planning/ (zeroq-plan, offload="auto") runs once before launch and reads the
    # engine's arithmetic. The arrow goes one way, whatever the import's form (lazy, TYPE_CHECKING).
    offenders = sorted(f"{name} imports {target}" for name, targets in _graph().items()
                       if name.startswith("lightning_zeroq.zero") for target in targets
                       if target.startswith("lightning_zeroq.planning"))
    assert not offenders, offenders


PLACEMENT_BASE = "OptimizerHome"
"""The placement of masters and optimizer state (``offload/device.py``); every other one derives from it."""
OFFLOAD_KINDS = {
    "device.py": "placement", "host.py": "placement", "split.py": "placement", "auto.py": "placement",
    "nvme.py": "placement", "stores.py": "store", "roles.py": "roles", "select.py": "factory",
    "host_grads.py": "host part", "host_kernel.py": "host part", "host_worker.py": "host part",
    "speculative_step.py": "host part", "async_step.py": "host part",
}
"""Every module of ``zero/offload/`` and what it is: a placement (defines one), the stage-3 shard stores, the
roles a placement plays, the factories that pick them, or a part of the host placement (each imported by
``host.py`` or built on its ``HostOptimizer``). A new module there is one of these or belongs elsewhere."""


def _offload_violations(files: dict[str, ast.Module]) -> list[str]:
    """What breaks "``zero/offload/`` holds placements only" in ``files`` (file name -> parsed module)."""
    classes = {n.name: n for tree in files.values() for n in tree.body if isinstance(n, ast.ClassDef)}

    def is_placement(cls: ast.ClassDef) -> bool:
        bases = [ast.unparse(b).split(".")[-1] for b in cls.bases]
        return cls.name == PLACEMENT_BASE or any(b in classes and is_placement(classes[b]) for b in bases)

    def is_store(cls: ast.ClassDef) -> bool:
        return {"put", "get", "device_tensors", "close"} <= {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}

    host = files.get("host.py", ast.parse(""))
    imported_by_host = {part for n in ast.walk(host) if isinstance(n, ast.ImportFrom) and n.module
                        for part in (n.module.rsplit(".", 1)[-1], *(a.name for a in n.names))}
    found = []
    for name, tree in sorted(files.items()):
        if name == "__init__.py":
            continue
        kind = OFFLOAD_KINDS.get(name)
        own = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        if kind is None:
            found.append(f"offload/{name} is not a placement, a store, the roles, the factories or a host part")
        elif kind == "placement" and not any(is_placement(c) for c in own):
            found.append(f"offload/{name} defines no placement (a {PLACEMENT_BASE})")
        elif kind == "store" and not (own and all(is_store(c) or c.name == "ShardStore" for c in own)):
            found.append(f"offload/{name} holds something other than shard stores")
        elif kind == "factory" and any(isinstance(n, ast.ClassDef) for n in tree.body):
            found.append(f"offload/{name} defines classes; the factories only pick them")
        elif kind == "host part" and name[:-3] not in imported_by_host and "HostOptimizer" not in names:
            found.append(f"offload/{name} is neither imported by host.py nor built on HostOptimizer")
    return found


def test_the_offload_check_finds_what_is_no_placement():
    files = {
        "device.py": ast.parse("class OptimizerHome: pass"),
        "host.py": ast.parse("from x.host_kernel import KernelSteps\nclass HostOptimizer(OptimizerHome): pass"),
        "split.py": ast.parse("class Split: pass"),
        "host_kernel.py": ast.parse("class KernelSteps: pass"),
        "async_step.py": ast.parse("class AsyncHostStep: pass"),
        "host_need.py": ast.parse("def need(): return 1"),
    }
    assert _offload_violations(files) == [
        "offload/async_step.py is neither imported by host.py nor built on HostOptimizer",
        "offload/host_need.py is not a placement, a store, the roles, the factories or a host part",
        "offload/split.py defines no placement (a OptimizerHome)",
    ]


def test_offload_holds_placements_only():
    # zero/offload/ is where masters, optimizer state and resting shards live (placements and stores) and
    # the host placement's own parts; what counts bytes lives in zero/memory/, what plans in planning/.
    files = {p.name: ast.parse(p.read_text(encoding="utf-8")) for p in sorted((PACKAGE / "zero" / "offload").glob("*.py"))}
    assert not _offload_violations(files), _offload_violations(files)
    assert set(files) - {"__init__.py"} == set(OFFLOAD_KINDS), "OFFLOAD_KINDS names a module that is gone"


THREAD_MAKERS = ("Thread", "Condition")
HOST_WORKER = "zero/offload/host_worker.py"
"""The one module of the engine that starts a thread or waits on a condition: the host's worker. Speculative and
asynchronous host steps are jobs on its one thread, and everything that waits for them calls its one ``wait``."""


def _threads_made(tree: ast.Module) -> list[str]:
    """The calls in ``tree`` that make a thread or a condition (``threading.Thread(...)``, ``Condition()``)."""
    return sorted(ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)
                  and ast.unparse(n.func).rsplit(".", 1)[-1] in THREAD_MAKERS)


def test_the_thread_finder_finds_threads_and_conditions():
    tree = ast.parse("import threading\nt = threading.Thread(target=f)\nc = Condition()\nl = threading.Lock()\n")
    assert _threads_made(tree) == ["Condition", "threading.Thread"]


def test_only_the_host_worker_starts_threads_in_the_engine():
    # One worker thread runs what the host steps beside the calling thread (offload/host_worker.py); a part
    # that needs work done there submits it as a job instead of keeping a thread, a queue and a wait of its own.
    offenders = [f"{path.relative_to(PACKAGE)}: {made}" for path in sorted((PACKAGE / "zero").rglob("*.py"))
                 if str(path.relative_to(PACKAGE)) != HOST_WORKER
                 for made in _threads_made(ast.parse(path.read_text(encoding="utf-8")))]
    assert not offenders, offenders
    assert _threads_made(_tree(HOST_WORKER)), "the host's worker makes its thread"


# ------------------------------------------------------------------ the maps: docs/layout.md, zero/README.md

REPO = PACKAGE.parent
ZERO_README_MAX_ROWS = 12


def _table_rows(markdown: str) -> list[list[str]]:
    """The cells of every table row of ``markdown`` (header and rule rows left out)."""
    rows = []
    for line in markdown.splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append(cells)
    return [r for r in rows if r[0] not in ("where", "room", "room or files")]


def _named(cell: str) -> list[str]:
    return [n for n in cell.split("`")[1::2]]


def _entries(folder: Path) -> set[str]:
    """A folder's modules, files of note and subfolders (``name/``), as a map names them."""
    return {p.name + "/" if p.is_dir() else p.name for p in folder.iterdir()
            if not p.name.startswith((".", "__pycache__")) and (p.is_dir() or p.suffix in (".py", ".md"))}


def _map_mismatches(named: set[str], present: set[str], where: str) -> list[str]:
    return ([f"{where} does not name {n}" for n in sorted(present - named)]
            + [f"{where} names {n}, which is not there" for n in sorted(named - present)])


def test_the_map_check_finds_a_missing_and_a_stale_name():
    rows = _table_rows("| room or files | what |\n|---|---|\n| `a.py`, `b/` | x |\n| `gone.py` | y |\n")
    named = {n for row in rows for n in _named(row[0])}
    assert _map_mismatches(named, {"a.py", "b/", "new.py"}, "README") == [
        "README does not name new.py", "README names gone.py, which is not there"]


def test_docs_layout_names_every_package_folder_and_room():
    rows = _table_rows((REPO / "docs" / "layout.md").read_text(encoding="utf-8"))
    named = {n.removeprefix("lightning_zeroq/") for row in rows for n in _named(row[0])}
    top = {n for n in named if n == "zero/" or not n.startswith("zero/")}
    rooms = {n.removeprefix("zero/") for n in named - top if n != "zero/*.py"}
    present = {e for e in _entries(PACKAGE) if e != "__init__.py"}
    zero_rooms = {e for e in _entries(PACKAGE / "zero") if e.endswith("/")}
    problems = _map_mismatches(top, present, "docs/layout.md") + _map_mismatches(rooms, zero_rooms,
                                                                                  "docs/layout.md's rooms")
    assert not problems, problems


def test_zero_readme_is_a_short_table_of_every_room_and_file():
    rows = _table_rows((PACKAGE / "zero" / "README.md").read_text(encoding="utf-8"))
    assert len(rows) <= ZERO_README_MAX_ROWS, f"zero/README.md has {len(rows)} rows; group files into rooms"
    named = {n for row in rows for n in _named(row[0])}
    problems = _map_mismatches(named, _entries(PACKAGE / "zero"), "zero/README.md")
    for row in rows:  # a room's row names each of its modules
        for room in (n for n in _named(row[0]) if n.endswith("/")):
            modules = {e for e in _entries(PACKAGE / "zero" / room) if e.endswith(".py") and e != "__init__.py"}
            problems += [f"zero/README.md's {room} row does not name {m}" for m in sorted(modules - set(_named(row[1])))]
    assert not problems, problems
