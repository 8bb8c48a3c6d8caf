"""protoserve-client's wheel carries what its build generates: the gRPC stubs and the blocking client.

Neither is committed: the wheel build runs protoc over proto/ and unasync over
protoserve_client/aio.py (clients/python/build_backend/). The build runs on a
copy of the files git knows, so nothing `make install` left in the repo (gen/,
the editable install's client.py) can stand in for what the build must make.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "clients" / "python"
# What the build reads: the client project and the protos it compiles.
SOURCES = ("clients/python", "proto", "third_party/googleapis")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """The wheel, and the copy of the sources it was built from."""
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *SOURCES],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            source / "clients" / "python",
            "-w",
            dist,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (wheel,) = dist.glob("protoserve_client-*.whl")
    return wheel, source / "clients" / "python"


def test_the_copy_built_from_has_no_generated_client(built):
    _, project = built
    assert (project / "protoserve_client" / "aio.py").is_file()
    assert not (project / "protoserve_client" / "client.py").exists()
    assert not (project / "protoserve_client" / "_sync_streams.py").exists()


def test_the_wheel_holds_the_stubs_and_the_client_generated_from_aio_py(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for required in (
            "protoserve_client/aio.py",
            "protoserve_client/_aio_io.py",
            "protoserve_client/_sync_io.py",
            "protoserve_client/_pb/protoserve/v1/inference_pb2_grpc.py",
        ):
            assert required in names, required
        # The repo's client.py comes from the same aio.py through the same pinned unasync.
        for generated in ("client.py", "_sync_streams.py"):
            assert archive.read(f"protoserve_client/{generated}").decode() == (
                CLIENT / "protoserve_client" / generated
            ).read_text(encoding="utf-8")


def test_the_wheels_blocking_client_imports_with_the_async_ones_methods(built, tmp_path: Path):
    wheel, _ = built
    zipfile.ZipFile(wheel).extractall(tmp_path)
    # The repo's editable install still answers for any module the wheel lacks:
    # every protoserve_client module loaded must come from the wheel.
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import protoserve_client as p; "
        "from protoserve_client._stubs import inference_pb2; "
        "ours = {n: m.__file__ for n, m in sys.modules.items() if n.startswith('protoserve_client')}; "
        "assert all(f.startswith(sys.argv[1]) for f in ours.values()), ours; "
        "assert 'protoserve_client.client' in ours and 'protoserve_client._pb' in ours, ours; "
        "names = lambda c: sorted(n for n in vars(c) if not n.startswith('_')); "
        "assert names(p.Client) == names(p.AsyncClient), (names(p.Client), names(p.AsyncClient)); "
        "print(len(names(p.Client)))"
    )
    result = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert int(result.stdout) > 20
