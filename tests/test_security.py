"""No open door: a local run listens on loopback only, and code planted in the working
directory never runs in the processes partrain starts (issue 19, items 1 and 2)."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from partrain.distributed.spawn import python_command

pytestmark = pytest.mark.multiproc

# the console script: it starts with its own directory, not the working directory, on the path
PARTRAIN = str(Path(sys.executable).with_name("partrain"))


def _listening_sockets() -> dict[str, str]:
    """socket inode -> 'address:port' for every listening TCP socket on the machine (/proc/net)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found[fields[9]] = f"{ipaddress.ip_address(raw)}|{int(hex_port, 16)}"
    return found


def _process_tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            tree.add(child)
            todo.append(child)
    return tree


def _listeners_of(pids: set[int]) -> set[str]:
    sockets, owned = _listening_sockets(), set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in sockets:
                    owned.add(sockets[target[8:-1]])
        except OSError:
            continue  # the process ended while we looked
    return owned


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("workers", [1, 2])
def test_a_local_run_listens_on_loopback_only(workers, data_dir, tmp_path):
    """Every listening socket of the launcher and its workers, polled through the run."""
    cmd = [PARTRAIN, "train", "--model", "mlp", "--strategy", "ddp", "--workers", str(workers), "--steps", "300",
           "--limit", "2560", "--eval-limit", "64", "--data-dir", str(data_dir), "--quiet", "--threads", "1"]
    scratch = tmp_path / "tmp"  # the run's $TMPDIR: what it leaves there is litter
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, processes = set(), set()
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        tree = _process_tree(proc.pid)
        processes |= tree
        seen |= _listeners_of(tree)
        time.sleep(0.02)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert len(processes) >= workers  # we watched the workers themselves
    assert seen, "a ddp run's gloo group listens somewhere; the probe saw nothing"
    outside = [s for s in seen if not ipaddress.ip_address(s.split("|")[0]).is_loopback]
    assert not outside, f"listening beyond loopback: {outside}"
    # torch's own per-user compile cache (torchinductor_<user>) is shared, not litter of this run
    assert not [p for p in scratch.iterdir() if not p.name.startswith("torchinductor_")], "temporary files left behind"


def _plant(directory: Path) -> Path:
    """Modules that shadow what partrain imports; each leaves a marker if it ever runs."""
    marker = directory / "PLANTED_CODE_RAN"
    for name in ("numpy", "rich", "multiprocessing", "partrain"):
        (directory / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write('{name}\\n')\n")
    return marker


def test_children_start_with_the_working_directory_off_the_import_path(tmp_path):
    marker = _plant(tmp_path)
    subprocess.run([*python_command(), "-c", "import numpy, rich"], cwd=tmp_path, check=True)
    assert not marker.exists()


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])  # the default, and the suite's (tests/conftest.py)
def test_planted_modules_never_run_in_a_two_worker_run_or_a_bench_cell(data_dir, tmp_path, start_method):
    marker = _plant(tmp_path)
    suite = tmp_path / "suite.toml"
    suite.write_text(
        'name = "planted"\nmodels = ["mlp"]\ndatasets = ["mnist"]\nstrategies = ["ddp"]\nworkers = [2]\n'
        "batch_sizes = [32]\nwarmup_steps = 1\nsteps = 2\nlimit = 256\nthreads = 1\n"
    )
    env = {**os.environ, "PARTRAIN_DATA_DIR": str(data_dir), "PARTRAIN_START_METHOD": start_method}
    train = subprocess.run([PARTRAIN, "train", "--strategy", "ddp", "--workers", "2", "--steps", "3", "--limit", "256",
                            "--eval-limit", "32", "--quiet"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert train.returncode == 0, train.stderr
    bench = subprocess.run([PARTRAIN, "bench", str(suite), "--store", str(tmp_path / "s.sqlite")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert bench.returncode == 0, bench.stderr
    assert not marker.exists(), marker.read_text()
