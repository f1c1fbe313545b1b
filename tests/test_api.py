"""The public API keeps its shape: the names in ``async_array.__all__``, what
kind of object each is, and each callable's parameters (names, kinds and
defaults). Annotations are left out, so that a more precise type is not an
API change; a renamed, added or removed name or parameter is."""

import inspect

import async_array as aa

# name -> (kind, parameters without annotations; None where there is no signature)
API = {
    "ALL_COMPLETED": ("str", None),
    "FIRST_COMPLETED": ("str", None),
    "FIRST_EXCEPTION": ("str", None),
    "AsyncArray": ("class", "(source, index, aval, sharding, committed=None)"),
    "DoneAndNotDone": ("class", "(done, not_done)"),
    "HostBuffer": ("class", "(shape, dtype)"),
    "RemoteFailure": ("exception, a RuntimeError", None),
    "SafetensorsHeader": ("class", "(specs, metadata)"),
    "WaitCycleError": ("exception, a RuntimeError", None),
    "__version__": ("str", None),
    "as_completed": ("function", "(tree, timeout=None)"),
    "async_map": ("function", "(fn, like, *, sharding=None, per_shard=False)"),
    "async_stream": ("function", "(gen_fn, like, *, sharding=None)"),
    "async_wrap": ("function", "(f, *, shape=None, dtype=None, like=None, sharding=None)"),
    "configure": ("function", "(max_workers=None)"),
    "empty": ("function", "(shape, dtype)"),
    "future": ("function", "(tree)"),
    "jax_hooks_active": ("function", "()"),
    "jit": ("function", "(fun=None, **jit_kwargs)"),
    "load_safetensors": (
        "function",
        "(source, *, like=None, dtype=None, sharding=None, max_bytes_in_flight=None, timeout=None,"
        " retries=3, progress=False, headers=None, credentials=None)",
    ),
    "make_array_from_callback": ("function", "(shape, sharding, data_callback, *, dtype)"),
    "materialize": ("function", "(tree, timeout=None)"),
    "max_workers": ("function", "()"),
    "safetensors_header": (
        "function",
        "(source, *, timeout=None, retries=3, headers=None, credentials=None)",
    ),
    "wait": ("function", "(tree, timeout=None, return_when='ALL_COMPLETED')"),
}


def kind(obj: object) -> str:
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return f"exception, a {obj.__mro__[1].__name__}"
    if isinstance(obj, type):
        return "class"
    if inspect.isfunction(obj):
        return "function"
    return type(obj).__name__


def parameters(obj: object) -> str | None:
    """``obj``'s signature with its annotations removed, or None if it has none."""
    if not callable(obj) or (isinstance(obj, type) and issubclass(obj, BaseException)):
        return None
    sig = inspect.signature(obj)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def test_all_names_the_snapshot():
    assert sorted(aa.__all__) == sorted(API)


def test_each_public_name_keeps_its_kind_and_parameters():
    actual = {name: (kind(getattr(aa, name)), parameters(getattr(aa, name))) for name in API}
    assert actual == API
