"""The criu-dump hook's own checks, before it runs CRIU (no CRIU needed)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from support import ROOT
from support.timing import scaled, wait_until


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare to make a PID namespace")
def test_dump_refuses_a_process_whose_session_leader_is_outside_its_namespace(tmp_path):
    # inside a new PID namespace (with its own /proc), a process that did not setsid belongs to
    # a session led from outside: its session id reads 0 there, and CRIU cannot dump it
    script = (f'sleep 30 & CKPT_ENGINE_PID=$! CKPT_IMAGE_DIR={tmp_path} CKPT_CRIU=/bin/true '
              f'{ROOT / "hooks" / "criu-dump"}; rc=$?; kill $!; exit $rc')
    out = subprocess.run(["setsid", "unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                          script], capture_output=True, text=True, timeout=scaled(60))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "session whose leader is outside this PID namespace" in out.stderr
    assert "setsid" in out.stderr
    assert not list(tmp_path.iterdir())  # nothing was written


IO_URING_HOLDER = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)  # struct io_uring_params
fd = libc.syscall(425, 8, params)  # io_uring_setup (x86_64)
print(fd, flush=True)
time.sleep(60)
"""


def test_dump_refuses_an_engine_holding_io_uring_and_says_how_to_avoid_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", IO_URING_HOLDER], stdout=subprocess.PIPE,
                              text=True)
    try:
        if int(holder.stdout.readline()) < 0:
            pytest.skip("io_uring is not available here (kernel.io_uring_disabled?)")
        # the "engine" is this process; the holder, its child: the hook looks at the whole tree
        out = subprocess.run([str(ROOT / "hooks" / "criu-dump")], capture_output=True, text=True,
                             timeout=scaled(60), env={"PATH": os.environ["PATH"],
                                              "CKPT_ENGINE_PID": str(os.getpid()),
                                              "CKPT_IMAGE_DIR": str(tmp_path),
                                              "CKPT_CRIU": "/bin/true"})
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert out.returncode == 2, out.stdout + out.stderr
    assert "io_uring" in out.stderr and str(holder.pid) in out.stderr
    assert "kernel.io_uring_disabled" in out.stderr
    assert not list(tmp_path.iterdir())


def test_restore_treats_a_zombie_engine_as_gone(tmp_path):
    # a dump that stopped the engine leaves a zombie until its parent reaps it: not "alive"
    zombie = subprocess.Popen(["true"])
    wait_until(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE,
               what="exited, not yet reaped: a zombie")
    out = subprocess.run([str(ROOT / "hooks" / "criu-restore")], capture_output=True, text=True,
                         timeout=scaled(60), env={"PATH": os.environ["PATH"],
                                          "CKPT_ENGINE_PID": str(zombie.pid),
                                          "CKPT_IMAGE_DIR": str(tmp_path),
                                          "CKPT_CRIU": "/bin/true"})
    zombie.wait()
    assert out.returncode == 2 and "no CRIU image" in out.stderr, out.stdout + out.stderr


@pytest.fixture
def recorded_dump(tmp_path):
    """criu-dump run against a STAND-IN criu that only records its arguments, for a process
    that leads its own session (``setsid``) or one that does not."""
    standin = tmp_path / "criu-standin"
    standin.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$STANDIN_ARGS"\n'
                       ': > "$CKPT_IMAGE_DIR/inventory.img"\n'  # what marks an image
                       # STANDIN_PAGES=N: pages-1.img .. pages-N.img, each i * 70,000 bytes
                       'for i in $(seq 1 "${STANDIN_PAGES:-0}"); do head -c $((i * 70000))'
                       ' /dev/urandom > "$CKPT_IMAGE_DIR/pages-$i.img"; done\n')
    standin.chmod(0o755)
    procs = []

    def dump(*, leader: bool = True, **env) -> tuple[int, list[str], str, Path]:
        # the "engine" is a sleep; not a leader: a child of a shell that leads its own session,
        # so the session's leader is in this PID namespace wherever the tests themselves run
        # (a test runner's own session may be led from outside it, as in CI)
        script = "exec sleep 30" if leader else "sleep 30 & echo $!; wait"
        proc = subprocess.Popen(["setsid", "sh", "-c", script], stdout=subprocess.PIPE,
                                text=True)
        procs.append(proc)
        pid = proc.pid if leader else int(proc.stdout.readline())
        wait_until(lambda: psutil.Process(pid).name() == "sleep", what="the sleep running")
        image = tmp_path / f"img-{len(procs)}"
        image.mkdir()
        args_file = tmp_path / f"args-{len(procs)}"
        full = dict(os.environ, CKPT_ENGINE_PID=str(pid), CKPT_IMAGE_DIR=str(image),
                    CKPT_CRIU=str(standin), STANDIN_ARGS=str(args_file), **env)
        out = subprocess.run([str(ROOT / "hooks" / "criu-dump")], env=full,
                             capture_output=True, text=True, timeout=scaled(60))
        args = args_file.read_text().split("\n")[:-1] if args_file.exists() else []
        return out.returncode, args, out.stderr, image

    yield dump
    for proc in procs:
        os.killpg(proc.pid, signal.SIGKILL)  # the shell and its sleep
        proc.wait()
        proc.stdout.close()


def test_dump_options_map_to_criu_arguments(recorded_dump):
    rc, args, err, image = recorded_dump()
    assert rc == 0, err
    assert args[:2] == ["dump", "-t"] and "--tcp-close" in args and "--leave-running" in args
    assert "--skip-in-flight" in args  # a half-open connection must not fail the dump
    assert args[args.index("--ghost-limit") + 1] == "64M" and "--link-remap" in args
    assert "--file-locks" in args and "--shell-job" not in args
    assert (image / "criu-restore-options").read_text().split() == [
        "--ext-unix-sk", "--file-locks", "--tcp-close"]
    rc, args, err, _ = recorded_dump(CKPT_CRIU_TCP="established", CKPT_CRIU_MODE="stop",
                                     CKPT_CRIU_GHOST_LIMIT="1G", CKPT_CRIU_LINK_REMAP="0",
                                     CKPT_CRIU_EXTRA="--log-pid --timeout 9")
    assert rc == 0, err
    assert "--tcp-established" in args and args[args.index("--network-lock") + 1] == "nftables"
    assert "--leave-running" not in args and "--link-remap" not in args
    assert "--skip-in-flight" not in args
    assert args[args.index("--ghost-limit") + 1] == "1G"
    assert args[-3:] == ["--log-pid", "--timeout", "9"]
    rc, args, err, _ = recorded_dump(CKPT_CRIU_TCP="none")
    assert rc == 0 and not {"--tcp-close", "--tcp-established"} & set(args)


def test_a_process_that_does_not_lead_its_session_is_dumped_as_a_shell_job(recorded_dump):
    rc, args, err, image = recorded_dump(leader=False)
    assert rc == 0, err
    assert "--shell-job" in args
    assert "--shell-job" in (image / "criu-restore-options").read_text().split()


@pytest.mark.parametrize("bad", [{"CKPT_CRIU_TCP": "maybe"}, {"CKPT_CRIU_MODE": "pause"},
                                 {"CKPT_CRIU_LINK_REMAP": "yes"},
                                 {"CKPT_PAGE_SERVER": "10.0.0.1"},
                                 {"CKPT_PAGE_SERVER": "10.0.0.1:0"},
                                 {"CKPT_PAGE_SERVER": "10.0.0.1:70000"},
                                 {"CKPT_PAGE_SERVER": "10.0.0.1:p"},
                                 {"CKPT_PAGE_SERVER": "[not-v6]:80"},
                                 {"CKPT_PAGE_SERVER": "a;b:80"}])
def test_a_bad_setting_is_refused_before_criu_runs(recorded_dump, bad):
    rc, args, err, _ = recorded_dump(**bad)
    assert rc == 2 and args == [] and next(iter(bad)) in err


def _restore(image: Path) -> subprocess.CompletedProcess:
    """criu-restore of ``image`` with /bin/true for criu: only its own checks run."""
    return subprocess.run([str(ROOT / "hooks" / "criu-restore")], capture_output=True, text=True,
                          timeout=scaled(60), env={"PATH": os.environ["PATH"],
                                           "CKPT_ENGINE_PID": "999999999",
                                           "CKPT_IMAGE_DIR": str(image), "CKPT_CRIU": "/bin/true",
                                           "CKPT_RESTORE_WAIT_S": "0"})


def test_restore_checks_the_image_against_the_manifest_of_its_dump(recorded_dump):
    rc, _, err, image = recorded_dump()
    assert rc == 0, err
    listed = [line.split(" ", 2)[2] for line in (image / "criu-manifest").read_text().splitlines()]
    assert "./inventory.img" in listed and "./criu-restore-options" in listed
    assert _restore(image).returncode == 0  # intact
    options = image / "criu-restore-options"
    text = options.read_text()
    options.write_text(text.replace("--file-locks", "--file-lockz"))  # same size, one byte off
    out = _restore(image)
    assert out.returncode == 2 and f"the image in {image} is damaged: ./criu-restore-options: " \
        "its checksum differs" in out.stderr, out.stderr
    options.write_text(text[:-5])
    out = _restore(image)
    assert out.returncode == 2 and f"./criu-restore-options: {len(text) - 5} bytes, " \
        f"{len(text)} at the dump" in out.stderr, out.stderr
    options.write_text(text)
    (image / "pages-9.img").write_bytes(b"planted")
    out = _restore(image)
    assert out.returncode == 2 and "./pages-9.img: not in the image's manifest" in out.stderr
    (image / "pages-9.img").unlink()
    assert _restore(image).returncode == 0


def test_each_pages_file_is_checked_though_they_are_summed_side_by_side(recorded_dump):
    """The pages files are summed a cksum each, several at once: the manifest still lists
    every file once, by name, with cksum's own line, and a restore names whichever is off."""
    rc, _, err, image = recorded_dump(STANDIN_PAGES="5")
    assert rc == 0, err
    lines = (image / "criu-manifest").read_text().splitlines()
    names = [line.split(" ", 2)[2] for line in lines]
    assert names == sorted(names) and len(names) == len(set(names))
    pages = [f"./pages-{i}.img" for i in range(1, 6)]
    assert set(pages) <= set(names) and "./inventory.img" in names
    alone = subprocess.run(["cksum", *names], cwd=image, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert sorted(lines) == sorted(alone)
    assert _restore(image).returncode == 0
    third = image / "pages-3.img"
    data = bytearray(third.read_bytes())
    data[len(data) // 2] ^= 1
    third.write_bytes(bytes(data))
    out = _restore(image)
    assert out.returncode == 2 and "./pages-3.img: its checksum differs from the dump's" \
        in out.stderr, out.stderr
    data[len(data) // 2] ^= 1
    third.write_bytes(bytes(data))
    fifth = image / "pages-5.img"
    whole = fifth.read_bytes()
    fifth.write_bytes(whole[:1000])
    out = _restore(image)
    assert out.returncode == 2 and f"./pages-5.img: 1000 bytes, {len(whole)} at the dump" \
        in out.stderr, out.stderr
    fifth.unlink()
    out = _restore(image)
    assert out.returncode == 2 and "./pages-5.img: missing" in out.stderr, out.stderr
    fifth.write_bytes(whole)
    assert _restore(image).returncode == 0


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_restore_refuses_an_image_folder_others_may_change(recorded_dump, mode):
    # criu restores, as root, whatever the folder holds
    _, _, _, image = recorded_dump()
    image.chmod(mode)
    out = _restore(image)
    assert out.returncode == 2 and f"the image folder {image} may be changed by others" \
        in out.stderr, out.stderr


def test_a_migration_dump_leaves_the_tree_stopped_and_sends_its_pages_away(recorded_dump):
    rc, args, err, image = recorded_dump(CKPT_CRIU_MODE="leave-stopped",
                                         CKPT_PAGE_SERVER="169.254.77.2:4711")
    assert rc == 0, err
    assert "--leave-stopped" in args and "--leave-running" not in args
    assert args[args.index("--page-server") + 1:args.index("--page-server") + 5] == [
        "--address", "169.254.77.2", "--port", "4711"]
    assert (image / "criu-pages-remote").read_text() == "169.254.77.2:4711\n"
    assert "./criu-pages-remote" in (image / "criu-manifest").read_text()
    rc, args, err, _ = recorded_dump(CKPT_PAGE_SERVER="[fe80::1]:4712")
    assert rc == 0, err
    assert args[args.index("--address") + 1] == "fe80::1" and "--leave-running" in args


def test_restore_checks_pages_from_a_page_server_against_their_pagemaps(recorded_dump,
                                                                       tmp_path):
    """The pages and pagemaps a page server wrote are not in the manifest: they are held to
    the sizes the pagemaps promise instead; the restored root's PID is criu's pidfile's."""
    from test_criu_images import _image

    rc, _, err, image = recorded_dump(CKPT_PAGE_SERVER="169.254.77.2:4711")
    assert rc == 0, err
    _image(image)  # mm-1.img (as if shipped), pagemap-1.img and pages-7.img (page server)
    (image / "mm-1.img").unlink()  # not in this manifest: the pagemap check alone here
    standin = tmp_path / "criu-restore-standin"  # writes the pidfile it is given, as criu does
    standin.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = --pidfile ] && '
                       'printf 4242 > "$2"; shift; done\n')
    standin.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "CKPT_ENGINE_PID": "999999999",
           "CKPT_IMAGE_DIR": str(image), "CKPT_CRIU": str(standin), "CKPT_RESTORE_WAIT_S": "0"}

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([str(ROOT / "hooks" / "criu-restore")], capture_output=True,
                              text=True, timeout=scaled(60), env=env)

    out = run()
    assert out.returncode == 0, out.stderr
    assert f"restored the engine from {image} (pid 4242)" in out.stdout
    assert (image / "criu-restored-pid").read_text() == "4242"
    os.truncate(image / "pages-7.img", 4096)
    out = run()
    assert out.returncode == 2 and f"the image in {image} is damaged: ./pages-7.img: 4096 " \
        "bytes, its pagemap promises" in out.stderr and "169.254.77.2:4711" in out.stderr
    (image / "pages-7.img").unlink()
    out = run()
    assert out.returncode == 2 and "./pages-7.img: missing" in out.stderr, out.stderr


def test_criu_s_own_first_error_is_the_first_line_of_a_failed_hook(recorded_dump, tmp_path):
    """What the operator's error says is the hook's first stderr line: when criu restore
    (or dump) fails, CRIU's own first error from its log is in it ("Can't fork ... File
    exists"), not only "failed (1)" with the reason in a log that a failed migration's
    cleanup deletes."""
    rc, _, err, image = recorded_dump()
    assert rc == 0, err
    standin = tmp_path / "criu-failing"  # writes the log it is given, with CRIU's words
    standin.write_text(
        '#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && log="$2"; shift; done\n'
        'printf "(00.01) Warn: something\\n(00.02) 1: Error (criu/cr-restore.c:1234): '
        'Can\'t fork for 42: File exists\\n(00.03) Error (criu/cr-restore.c:99): later\\n" '
        '> "$CKPT_IMAGE_DIR/$log"\nexit 1\n')
    standin.chmod(0o755)
    out = subprocess.run([str(ROOT / "hooks" / "criu-restore")], capture_output=True,
                         text=True, timeout=scaled(60),
                         env={"PATH": os.environ["PATH"], "CKPT_ENGINE_PID": "999999999",
                              "CKPT_IMAGE_DIR": str(image), "CKPT_CRIU": str(standin),
                              "CKPT_RESTORE_WAIT_S": "0"})
    assert out.returncode == 1
    first = out.stderr.splitlines()[0]
    assert first == (f"criu-restore: criu restore of the image in {image} failed (1): Error "
                     "(criu/cr-restore.c:1234): Can't fork for 42: File exists"), out.stderr


def test_the_tree_is_read_once_whatever_its_processes_are_named(tmp_path):
    """criu-dump reads the engine's tree in one pass: its processes (a child included), the
    /dev/shm files they hold, and whether the engine leads its session, counted after the
    name's parenthesis. An engine named ``x) S 1 2 3`` (a name may hold spaces and a
    parenthesis) leads its session: a field count from the line's start read its session as
    ``3)`` and dumped it as a shell job, which a restore must then match."""
    standin = tmp_path / "criu-standin"
    standin.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$STANDIN_ARGS"\n'
                       ': > "$CKPT_IMAGE_DIR/inventory.img"\n')
    standin.chmod(0o755)
    weird = tmp_path / "x) S 1 2 3"
    weird.symlink_to("/bin/sh")  # the process's name is the name it was started by
    shm = Path(f"/dev/shm/ckpt-test-tree-{os.getpid()}")
    engine = subprocess.Popen([str(weird), "-c", f'exec 3>"{shm}"; sleep 30 & wait'],
                              start_new_session=True)
    try:
        wait_until(lambda: len(psutil.Process(engine.pid).children()) == 1 and shm.exists(),
                   what="the engine and its child running")
        child = psutil.Process(engine.pid).children()[0].pid
        image = tmp_path / "img"
        image.mkdir()
        args_file = tmp_path / "args"
        out = subprocess.run([str(ROOT / "hooks" / "criu-dump")], env=dict(
            os.environ, CKPT_ENGINE_PID=f" {engine.pid} ", CKPT_IMAGE_DIR=str(image),
            CKPT_CRIU=str(standin), STANDIN_ARGS=str(args_file)),
            capture_output=True, text=True, timeout=scaled(60))
        assert out.returncode == 0, out.stderr
        args = args_file.read_text().split("\n")
        assert args[:3] == ["dump", "-t", str(engine.pid)] and "--shell-job" not in args
        assert "--shell-job" not in (image / "criu-restore-options").read_text()
        assert (image / "criu-pids").read_text().split() == [str(engine.pid), str(child)]
        assert (image / "criu-shm-files").read_text().splitlines() == [str(shm)]
    finally:
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
        shm.unlink(missing_ok=True)
    # not a PID at all: said, before criu runs
    out = subprocess.run([str(ROOT / "hooks" / "criu-dump")], env=dict(
        os.environ, CKPT_ENGINE_PID="12x", CKPT_IMAGE_DIR=str(tmp_path), CKPT_CRIU="/bin/true"),
        capture_output=True, text=True, timeout=scaled(60))
    assert out.returncode == 2 and "CKPT_ENGINE_PID='12x' is not a PID" in out.stderr
    # a PID of no process (the engine ended): said, before criu runs
    gone = subprocess.Popen(["true"])
    gone.wait()
    out = subprocess.run([str(ROOT / "hooks" / "criu-dump")], env=dict(
        os.environ, CKPT_ENGINE_PID=str(gone.pid), CKPT_IMAGE_DIR=str(tmp_path),
        CKPT_CRIU=str(tmp_path / "no-criu-should-run")), capture_output=True, text=True,
        timeout=scaled(60))
    assert out.returncode == 2 and f"no process {gone.pid} (CKPT_ENGINE_PID) here" \
        in out.stderr, out.stderr
