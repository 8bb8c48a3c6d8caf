"""``Client`` is generated from ``AsyncClient`` (protoserve_client/aio.py, by unasync): the two stay twins.

Every public method, property and iteration or context protocol of each async
class has its blocking twin with the same parameters, defaults, annotations and
docstring; where the async one is a coroutine or an async iterator, the
blocking one returns the value or a plain iterator. And ``client.py`` is
exactly what ``aio.py`` generates now, so neither a hand edit nor a copy left
stale by an edit of ``aio.py`` (run ``make install``) goes unnoticed.
"""

from __future__ import annotations

import importlib.util
import inspect
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import protoserve_client
from protoserve_client import _aio_streams, _sync_streams, aio, client

PACKAGE = Path(protoserve_client.__file__).parent
BUILD_BACKEND = PACKAGE.parent / "build_backend" / "protoserve_client_build.py"

# (blocking, asyncio, constructor arguments with a stand-in call: no I/O happens before iterating)
TWINS = [
    (client.Client, aio.AsyncClient, ()),
    (_sync_streams.ServerStream, _aio_streams.AsyncServerStream, (object(), str)),
    (client.GenerateStream, aio.AsyncGenerateStream, (object(), "request-1")),
    (client.RagAnswerStream, aio.AsyncRagAnswerStream, (object(),)),
    (client.AgentRun, aio.AsyncAgentRun, (object(),)),
]
TWIN_IDS = [sync.__name__ for sync, _, _ in TWINS]
# The protocols each flavour has under its own names.
PROTOCOLS = {
    "__aiter__": "__iter__",
    "__anext__": "__next__",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
}


def _blocking_name(name: str) -> str:
    """What the blocking twin calls a name or annotation of the asyncio client."""
    return PROTOCOLS.get(name, name.replace("Async", ""))


def _surface(cls: type) -> dict[str, Any]:
    """What a user of the class calls or reads: public methods and properties, ``__init__`` and the protocols."""
    dunders = {"__init__", *PROTOCOLS, *PROTOCOLS.values()}
    names = [n for n in dir(cls) if not n.startswith("_") or n in dunders]
    return {n: inspect.getattr_static(cls, n) for n in names}


def _kind(fn: Any) -> str:
    if inspect.iscoroutinefunction(fn):
        return "coroutine"
    if inspect.isasyncgenfunction(fn):
        return "async iterator"
    if inspect.isgeneratorfunction(fn):
        return "iterator"
    return "value"


# An awaited coroutine gives what the blocking call returns; an async iterator
# yields what the blocking one does; the rest return at once in both.
BLOCKING_KIND = {"coroutine": "value", "async iterator": "iterator", "value": "value"}


def _shape(
    fn: Any, rename: Callable[[str], str] = lambda s: s
) -> tuple[list[tuple[str, str, Any, str]], str]:
    """Parameters (name, kind, default, annotation) and return annotation, names renamed."""
    sig = inspect.signature(fn)
    params = [(p.name, p.kind.name, p.default, rename(str(p.annotation))) for p in sig.parameters.values()]
    return params, rename(str(sig.return_annotation))


@pytest.mark.parametrize(("sync_cls", "async_cls", "args"), TWINS, ids=TWIN_IDS)
def test_the_blocking_twin_has_the_same_methods_and_properties(sync_cls, async_cls, args):
    assert {_blocking_name(n) for n in _surface(async_cls)} == set(_surface(sync_cls))
    assert sync_cls.__doc__ == async_cls.__doc__


@pytest.mark.parametrize(("sync_cls", "async_cls", "args"), TWINS, ids=TWIN_IDS)
def test_each_method_has_the_same_signature_and_docstring_and_blocks_where_the_async_one_awaits(
    sync_cls, async_cls, args
):
    sync_surface = _surface(sync_cls)
    for name, async_attr in _surface(async_cls).items():
        sync_attr = sync_surface[_blocking_name(name)]
        if isinstance(async_attr, property):
            assert isinstance(sync_attr, property), name
            assert sync_attr.fget.__doc__ == async_attr.fget.__doc__, name
            continue
        assert _shape(sync_attr) == _shape(async_attr, _blocking_name), name
        assert _kind(sync_attr) == BLOCKING_KIND[_kind(async_attr)], name
        assert sync_attr.__doc__ == async_attr.__doc__, name


def test_the_methods_that_start_a_call_at_once_are_plain_in_both():
    # stream() and friends start the call and hand back the stream object: no
    # coroutine in AsyncClient, no generator in Client.
    for name in ("stream", "retrieve_and_generate_stream", "run_agent"):
        assert _kind(getattr(aio.AsyncClient, name)) == _kind(getattr(client.Client, name)) == "value", name
    assert _kind(aio.AsyncClient.generate) == "coroutine"
    assert _kind(aio.AsyncClient.iter_documents) == "async iterator"
    assert _kind(client.Client.iter_documents) == "iterator"


@pytest.mark.parametrize(("sync_cls", "async_cls", "args"), TWINS[1:], ids=TWIN_IDS[1:])
def test_the_streams_hold_the_same_public_attributes(sync_cls, async_cls, args):
    def attributes(cls: type) -> dict[str, Any]:
        return {k: v for k, v in vars(cls(*args)).items() if not k.startswith("_")}

    assert attributes(sync_cls) == attributes(async_cls)


def test_client_py_is_what_aio_py_generates_now(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("protoserve_client_build", BUILD_BACKEND)
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    for source in build.SYNC_TWINS:
        shutil.copy(PACKAGE / source, tmp_path / source)
    build.generate_sync_client(tmp_path)
    for source, target in build.SYNC_TWINS.items():
        generated = (tmp_path / target).read_text(encoding="utf-8")
        assert (PACKAGE / target).read_text(encoding="utf-8") == generated, (
            f"protoserve_client/{target} differs from what {source} generates: edit {source}, then run `make install`"
        )
        assert generated.startswith(build.SYNC_CLIENT_HEADER.replace("aio.py", source))
