"""The stub file python/collimate_core/_core.pyi must describe the native module exactly.

Checked both ways: every name, class member, base class and parameter list of `collimate_core._core`
is in the stub, and the stub claims nothing the module lacks. Underscore-prefixed stub names that
the module does not have are typing helpers (TypedDicts, aliases) and are allowed.
"""

import ast
import inspect
from pathlib import Path

import pytest

import collimate_core
from collimate_core import _core

STUB = Path(collimate_core.__file__).with_name("_core.pyi")


def _stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text(), filename=str(STUB))


def _stub_top_level() -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in _stub_tree().body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def _module_names() -> set[str]:
    return {n for n in vars(_core) if not n.startswith("__")}


def _stub_classes() -> dict[str, ast.ClassDef]:
    return {n: c for n, c in _stub_top_level().items() if isinstance(c, ast.ClassDef)}


def _runtime_classes() -> list[str]:
    return sorted(n for n in _module_names() if isinstance(getattr(_core, n), type))


def test_every_module_name_is_in_the_stub():
    missing = _module_names() - set(_stub_top_level())
    assert not missing, f"in collimate_core._core but not in {STUB.name}: {sorted(missing)}"


def test_every_stub_name_is_in_the_module():
    extra = {
        n
        for n in _stub_top_level()
        if n not in _module_names() and not (n.startswith("_") and n != "_vmm_main")
    }
    assert not extra, f"in {STUB.name} but not in collimate_core._core: {sorted(extra)}"
    assert "_vmm_main" in _module_names()


def _stub_members(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}


def _decorators(fn: ast.FunctionDef) -> set[str]:
    return {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}


@pytest.mark.parametrize("name", _runtime_classes())
def test_class_members_match(name):
    cls = getattr(_core, name)
    stub = _stub_classes()[name]
    stub_members = _stub_members(stub)
    own = vars(cls)
    runtime_public = {m for m in own if not m.startswith("_")}
    stub_public = {m for m in stub_members if not m.startswith("_")}
    assert runtime_public == stub_public, (
        f"{name}: only at runtime {sorted(runtime_public - stub_public)}, "
        f"only in the stub {sorted(stub_public - runtime_public)}"
    )
    for member, fn in stub_members.items():
        if member.startswith("__") and member not in own:
            # Dunders the stub claims must be the class's own (not object's defaults).
            pytest.fail(f"{name}.{member} is in the stub but the class does not define it")
        kind = "property" if "property" in _decorators(fn) else "method"
        runtime = own.get(member)
        if kind == "property":
            assert inspect.isdatadescriptor(runtime), f"{name}.{member}: stub says property"
        else:
            assert callable(getattr(cls, member)), f"{name}.{member}: stub says method"
            is_static = isinstance(runtime, staticmethod)
            assert is_static == ("staticmethod" in _decorators(fn)), (
                f"{name}.{member}: staticmethod in one and not the other"
            )


def test_exception_bases_match():
    for name, stub in _stub_classes().items():
        runtime = getattr(_core, name, None)
        if not (isinstance(runtime, type) and issubclass(runtime, BaseException)):
            continue
        stub_bases = [b.id for b in stub.bases if isinstance(b, ast.Name)]
        assert [runtime.__base__.__name__] == stub_bases, name
        assert runtime.__module__ == "collimate_core._core"


def _stub_params(fn: ast.FunctionDef) -> list[tuple[str, object]]:
    """(name, default) pairs; default is `inspect.Parameter.empty` when there is none."""
    args = fn.args.posonlyargs + fn.args.args
    defaults = [inspect.Parameter.empty] * (len(args) - len(fn.args.defaults)) + [
        ast.literal_eval(d) for d in fn.args.defaults
    ]
    return [(a.arg, d) for a, d in zip(args, defaults)]


def _runtime_params(obj) -> list[tuple[str, object]]:
    sig = inspect.signature(obj)
    return [(p.name, p.default) for p in sig.parameters.values()]


def _signature_cases():
    cases = []
    for name in _runtime_classes():
        stub = _stub_classes()[name]
        for member, fn in _stub_members(stub).items():
            if "property" in _decorators(fn) or member in ("__enter__", "__exit__"):
                continue
            cases.append((name, member))
    return cases


@pytest.mark.parametrize(("cls_name", "member"), _signature_cases())
def test_method_parameters_match(cls_name, member):
    cls = getattr(_core, cls_name)
    fn = _stub_members(_stub_classes()[cls_name])[member]
    runtime = _runtime_params(getattr(cls, member))
    stub = _stub_params(fn)
    if "staticmethod" not in _decorators(fn):
        # Unbound methods report `self` in their text signature too.
        assert stub[0][0] == "self"
    assert [n for n, _ in runtime] == [n for n, _ in stub], f"{cls_name}.{member}"
    for (n, rd), (_, sd) in zip(runtime, stub):
        if rd is not inspect.Parameter.empty and rd is not Ellipsis:
            assert rd == sd, f"{cls_name}.{member}: default of {n}"
        assert (rd is inspect.Parameter.empty) == (sd is inspect.Parameter.empty), (
            f"{cls_name}.{member}: {n} has a default in one and not the other"
        )


def test_package_reexports_the_module():
    # Every public name of the native module is re-exported as is; the package adds the SDK.
    public = {n for n in _module_names() if not n.startswith("_")}
    assert public <= set(collimate_core.__all__)
    for name in public:
        assert getattr(collimate_core, name) is getattr(_core, name)
    for name in collimate_core.__all__:
        assert hasattr(collimate_core, name), name


def test_collimate_rl_is_the_same_surface():
    import collimate_rl

    assert set(collimate_core.__all__) <= set(collimate_rl.__all__)
    for name in collimate_core.__all__:
        assert getattr(collimate_rl, name) is getattr(collimate_core, name)
