"""The suite's preloaded Python (tests/helpers/preloaded_python.py) runs a command as a fresh
interpreter does: the same output, errors and exit status, the command's environment and
folder, its threads and exit functions; a timeout kills it; a command started to be read and
signalled while it runs behaves as a subprocess does; what it cannot imitate runs as a
subprocess."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import (PRELOADED_PYTHON, clean_env, run_command, script_env, script_python,
                      start_command)
from helpers.preloaded_python import IMITATED_PYTHONS, ForkedProcess, parse, run_subprocess
from helpers.training import stop

pytestmark = pytest.mark.skipif(
    sys.version_info[:2] not in IMITATED_PYTHONS,
    reason="the preloaded interpreter imitates CPython 3.11 and 3.12; on this Python the suite "
           "starts a fresh interpreter for every command")

SCRIPT = textwrap.dedent("""\
    import atexit, os, sys, threading, time
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "X", os.environ.get("X"))
    print("plug-in loaded:", "multipath_nmt" in sys.modules, "main:", __name__)
    print("to stderr", file=sys.stderr)
    atexit.register(print, "at exit")

    def after_the_command():  # a thread the interpreter's exit must wait for, with no fixed delay
        while threading.main_thread().is_alive():  # until the exit stops the main thread
            time.sleep(0.005)
        print("thread done")

    threading.Thread(target=after_the_command).start()
    mode = sys.argv[1]
    if mode == "raise":
        raise ValueError("bad value")
    if mode == "message":
        sys.exit("stopped: a message")
    if mode == "hook":  # the plug-in's one-line errors ask which program runs
        sys.excepthook = lambda *error: print("hook:", sys.modules["__main__"].__file__,
                                              sys.argv, file=sys.stderr)
        raise ValueError("bad value")
    sys.exit(int(mode))
""")


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("preloaded") / "command.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("mode", ["0", "3", "raise", "message", "hook"])
# merged output goes the same way whatever the form: -c once, with separate streams
@pytest.mark.parametrize("form, merge_stderr", [("script", False), ("script", True), ("-u", False),
                                                ("-u", True), ("-c", False)])
def test_a_forked_command_gives_what_a_fresh_interpreter_gives(script, tmp_path, mode,
                                                               merge_stderr, form):
    args = {"script": [sys.executable, script],
            "-u": [sys.executable, "-u", script],
            "-c": [sys.executable, "-c", SCRIPT]}[form] + [mode, "second"]
    env = clean_env(X="from the command")
    assert PRELOADED_PYTHON.forkable(list(map(str, args)), env)
    forked = run_command(args, env=env, cwd=tmp_path, merge_stderr=merge_stderr)
    fresh = run_subprocess(list(map(str, args)), env, cwd=tmp_path, merge_stderr=merge_stderr)
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == {"0": 0, "3": 3, "raise": 1, "message": 1, "hook": 1}[mode]
    assert f"cwd {tmp_path} X from the command" in forked.stdout
    assert "plug-in loaded: False main: __main__" in forked.stdout
    assert forked.stdout.rstrip().endswith("thread done\nat exit")


@pytest.mark.slow  # two fresh interpreters that import fairseq
def test_modules_and_console_scripts_are_forked_and_say_the_same_as_fresh():
    env = clean_env()
    for args in ([sys.executable, "-m", "multipath_nmt.cli.average", "--inputs"],
                 [os.path.join(os.path.dirname(sys.executable), "multipath-average"), "--nope"]):
        assert PRELOADED_PYTHON.forkable(args, env)
        forked, fresh = run_command(args), run_subprocess(args, env)
        assert forked.returncode == fresh.returncode == 2
        assert forked.stderr == fresh.stderr and "error:" in forked.stderr


def test_what_a_fork_cannot_imitate_runs_as_a_subprocess():
    env = clean_env()
    assert not PRELOADED_PYTHON.forkable([sys.executable, "-", "x"], env)
    assert not PRELOADED_PYTHON.forkable([sys.executable, "-X", "importtime", "-m", "x"], env)
    assert not PRELOADED_PYTHON.forkable(["bash", "-c", "true"], env)
    # read when the interpreter and torch start: the server's values would be wrong
    threads = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    assert not PRELOADED_PYTHON.forkable(threads, clean_env(OMP_NUM_THREADS="2"))
    module = [sys.executable, "-m", "multipath_nmt.cli.average", "--help"]
    assert not PRELOADED_PYTHON.forkable(module, clean_env(PYTHONHASHSEED="1"))
    assert PRELOADED_PYTHON.forkable(module, clean_env(MULTIPATH_NMT_PATCHES="off"))
    # scikit-learn (imported by fairseq) sets KMP_* when imported, in the server as in the pytest
    # process, whose environment the commands inherit: set or not, a fresh interpreter ends
    # with those values; other values are not the server's
    imported = {"KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE"}
    launched = {k: v for k, v in PRELOADED_PYTHON.env.items() if k not in imported}
    assert PRELOADED_PYTHON.forkable(module, {**launched, **imported})
    assert PRELOADED_PYTHON.forkable(module, launched)
    assert not PRELOADED_PYTHON.forkable(module, {**launched, "KMP_INIT_AT_FORK": "TRUE"})


def _ends_soon(pid):
    """``pid`` is gone (killed and reaped, by init for an orphan) within 5 s."""
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)


def test_a_timeout_kills_the_command_and_what_it_started(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen(['sleep', '60'])\n"
                      "open(sys.argv[1], 'w').write(str(child.pid))\n"
                      "time.sleep(60)\n")
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([sys.executable, script, pid_file], timeout=3)
    _ends_soon(int(pid_file.read_text()))


@pytest.mark.slow  # fresh interpreters that import fairseq
@pytest.mark.parametrize("first", ["logging", "plug-in", "fairseq"])
def test_the_logging_of_a_command_is_configured_as_in_a_fresh_interpreter(tmp_path, first):
    """fairseq's import configures the root logger; fairseq-train configures it first (INFO to
    stdout), the plug-in's tools undo it, fairseq-preprocess configures it after the import
    (which then does nothing): the server's own import of fairseq changes none of these."""
    script = tmp_path / "logs.py"
    basic_config = ("logging.basicConfig(stream=sys.stdout, level=logging.INFO, "
                    "format='%(levelname)s %(name)s %(message)s')\n")
    configure = {"logging": basic_config + "import fairseq\n",
                 "plug-in": "import multipath_nmt\nimport fairseq\n",
                 "fairseq": "from fairseq import options\n" + basic_config}[first]
    script.write_text("import logging, sys\n" + configure +
                      "logging.getLogger('command').info('an info line')\n"
                      "logging.getLogger('command').warning('a warning')\n"
                      "print(len(logging.getLogger().handlers), logging.getLogger().level)\n")
    args, env = [sys.executable, str(script)], clean_env()
    forked, fresh = run_command(args, env=env), run_subprocess(args, env)
    # what fairseq logs while it is imported, the server logged (once, to no one)
    import_time = "INFO fairseq.tasks.text_to_speech Please install tensorboardX: " \
                  "pip install tensorboardX\n"
    assert forked.stdout == fresh.stdout.replace(import_time, "")
    assert forked.stdout == {
        "logging": "INFO command an info line\nWARNING command a warning\n1 20\n",
        "plug-in": "0 30\n", "fairseq": "1 30\n"}[first]
    assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:] == {
        "logging": fresh.stderr.splitlines()[-1:], "plug-in": ["a warning"],
        "fairseq": ["WARNING:command:a warning"]}[first]


@pytest.mark.slow  # an end-to-end fairseq-preprocess, in a fresh interpreter too
def test_fairseq_preprocess_prints_and_writes_what_a_fresh_one_does(tmp_path):
    """fairseq-preprocess imports fairseq before it configures logging: forked, it logs nothing
    and leaves an empty preprocess.log, as a fresh one does."""
    text = tmp_path / "train"
    for lang in ("en", "de"):
        text.with_suffix(f".{lang}").write_text("a b c\nb c d\n")
    def preprocess(destdir):
        return [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "en",
                "--target-lang", "de", "--trainpref", str(text), "--destdir", str(destdir),
                "--joined-dictionary", "--workers", "1"]

    forked = run_command(preprocess(tmp_path / "forked"))
    fresh = run_subprocess(preprocess(tmp_path / "fresh"), clean_env())
    assert [(proc.returncode, proc.stdout, (tmp_path / name / "preprocess.log").read_text())
            for proc, name in ((forked, "forked"), (fresh, "fresh"))] == [(0, "", "")] * 2


# Prints a line to stderr and one to stdout, then waits for the test's signal: with its own SIGTERM handler (as fairseq-train
# with the plug-in) or with the default dispositions.
WAITS_FOR_A_SIGNAL = textwrap.dedent("""\
    import signal, sys, time
    if sys.argv[1] == "handled":
        signal.signal(signal.SIGTERM, lambda *_: (print("stopping"), sys.exit(5)))
    print("to stderr", file=sys.stderr)
    print("ready", flush=True)
    time.sleep(60)
""")
# the same, waiting with a child of its own; both pids written to the file argv[2] names
WAITS_WITH_A_CHILD = WAITS_FOR_A_SIGNAL.replace("time.sleep(60)", textwrap.dedent("""\
    import subprocess
    child = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    open(sys.argv[2], "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(60)""")).replace("import signal", "import os, signal")


def _command_and_child(pids):
    """The two pids WAITS_WITH_A_CHILD writes into the file ``pids``, once it has."""
    while not pids.exists() or not pids.read_text():
        time.sleep(0.05)
    command, child = map(int, pids.read_text().split())
    return command, child


@pytest.mark.parametrize("how", [("handled", signal.SIGTERM), ("default", signal.SIGTERM),
                                 ("default", signal.SIGKILL)])
def test_a_started_command_is_read_while_it_runs_and_signalled_as_a_subprocess_is(tmp_path, how):
    """start_command forks what it can: the test reads its first line while it runs, signals its
    pid, and gets the output and exit status a fresh interpreter gives."""
    handling, signum = how
    script = tmp_path / "waits.py"
    script.write_text(WAITS_FOR_A_SIGNAL)
    args = [sys.executable, str(script), handling]
    forked = start_command(args)
    assert isinstance(forked, ForkedProcess)
    results = []
    for proc in (forked, subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env=clean_env())):
        first = proc.stdout.readline(), proc.stdout.readline()
        os.kill(proc.pid, signum)
        results.append((first, proc.stdout.read(), proc.wait()))
        proc.stdout.close()
    assert results[0] == results[1] == (
        ("to stderr\n", "ready\n"), "stopping\n" if handling == "handled" else "",
        5 if handling == "handled" else -signum)


def test_a_started_command_left_running_is_killed_and_frees_the_server(tmp_path):
    """A test that fails while reading a started command stops it (helpers.training.stop): it
    and its children are killed, and the server runs the next command."""
    script = tmp_path / "waits.py"
    script.write_text(WAITS_FOR_A_SIGNAL)
    proc = start_command([sys.executable, script, "default"])
    assert isinstance(proc, ForkedProcess)
    assert (proc.stdout.readline(), proc.stdout.readline()) == ("to stderr\n", "ready\n")
    stop(proc)
    assert proc.returncode == -signal.SIGKILL and proc.stdout.closed
    exits = script.with_name("exits.py")
    exits.write_text("raise SystemExit(3)\n")
    assert run_command([sys.executable, exits], timeout=60).returncode == 3  # the server answers


# --- the shim: the Python that scripts and forked commands start -------------------------------

SHOWS_ITS_PROCESS = textwrap.dedent("""\
    import os, sys
    print("parent", os.getppid(), "executable", sys.executable, "stdin", sys.stdin.read().strip())
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
""")


def test_a_script_s_python_is_forked_from_the_server_and_behaves_as_the_interpreter(tmp_path):
    """``"$PYTHON" script.py`` with the shim as PYTHON: the command runs in a child of the server,
    with the script's standard streams (stdin included), and exits with its status; what it
    starts through ``sys.executable`` is forked too. Other command lines, or another startup
    environment, run the interpreter itself in the shim's process."""
    shows = tmp_path / "shows.py"
    shows.write_text(SHOWS_ITS_PROCESS)
    shim, server = script_python(), PRELOADED_PYTHON.process.pid
    assert shim != sys.executable
    forked = subprocess.run([shim, shows, "3"], input="from stdin\n", capture_output=True,
                            text=True, env=clean_env())
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        3, f"parent {server} executable {shim} stdin from stdin\n", "to stderr\n")
    starts = tmp_path / "starts.py"
    starts.write_text("import subprocess, sys\n"
                      f"subprocess.run([sys.executable, {str(shows)!r}, '0'], input=b'nested')\n")
    nested = subprocess.run([shim, starts], capture_output=True, text=True, env=clean_env())
    assert nested.stdout == f"parent {server} executable {shim} stdin nested\n"
    by_code = subprocess.run([shim, "-c", shows.read_text(), "0"], input="code\n", capture_output=True,
                             text=True, env=clean_env())  # python -c: forked as well
    assert by_code.stdout == f"parent {server} executable {shim} stdin code\n"
    # the interpreter itself: the process is the shim's (the test is its parent)
    for args, env in (([shim, "-X", "utf8", shows, "0"], clean_env()),
                      ([shim, shows, "0"], clean_env(OMP_NUM_THREADS="2"))):
        itself = subprocess.run(args, capture_output=True, text=True, env=env)
        assert itself.stdout == f"parent {os.getpid()} executable {sys.executable} stdin \n"


def test_console_scripts_run_by_name_are_forked_and_answer_as_the_installed_ones(tmp_path):
    """A console script that a test (``run_command(["multipath-average", ...])``) or a script on
    :func:`script_env`'s PATH runs by name: the installed one for the test, forked from the
    server; for the script, a copy whose interpreter is the shim, which forks it. Both print
    and exit as the installed script does."""
    installed = os.path.join(os.path.dirname(sys.executable), "multipath-average")
    missing = ["--inputs", str(tmp_path / "none.pt"), "--output", str(tmp_path / "avg.pt")]
    fresh = run_subprocess([installed, *missing], clean_env())
    assert fresh.returncode == 1 and fresh.stderr.count("\n") == 1  # a one-line refusal

    assert PRELOADED_PYTHON.forkable([installed, *missing], clean_env())
    by_test = run_command(["multipath-average", *missing])
    env = script_env()
    found = subprocess.run(["bash", "-c", "command -v multipath-average"], env=env,
                           capture_output=True, text=True).stdout.strip()
    assert found == os.path.join(PRELOADED_PYTHON.console_scripts(), "multipath-average")
    with open(found) as copy:
        assert copy.readline() == f"#!{script_python()}\n"
    assert parse([sys.executable, found, *missing], sys.executable) is not None  # the shim forks it
    by_script = subprocess.run(["bash", "-c", 'multipath-average "$@"', "bash", *missing], env=env,
                               capture_output=True, text=True)
    for proc in (by_test, by_script):
        assert (proc.returncode, proc.stdout, proc.stderr) == (1, fresh.stdout, fresh.stderr)


@pytest.mark.parametrize("how", [("handled", signal.SIGTERM), ("default", signal.SIGTERM),
                                 ("default", signal.SIGINT), ("default", signal.SIGKILL)])
def test_a_signal_to_the_shim_is_one_to_its_command(tmp_path, how):
    """What a scheduler, torchrun or a test sends the shim's process reaches the command once,
    and the shim ends as the command does: the same output and exit status as the interpreter
    itself. SIGKILL, which the shim cannot pass on, takes the command and its children along."""
    handling, signum = how
    script = tmp_path / "waits.py"
    script.write_text(WAITS_WITH_A_CHILD)
    results = []
    for python in (script_python(), sys.executable):
        pids = tmp_path / f"pids-{len(results)}"
        # started as a terminal's foreground job: with SIGINT's default disposition, whatever
        # this test process has (a shell's background job has SIGINT ignored, and so would both)
        proc = subprocess.Popen([python, script, handling, pids], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=clean_env(),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        first = proc.stdout.readline(), proc.stdout.readline()
        command, sleeper = _command_and_child(pids)
        proc.send_signal(signum)
        results.append((first, proc.stdout.read(), proc.wait()))
        proc.stdout.close()
        if signum == signal.SIGKILL and python != sys.executable:
            for pid in (command, sleeper):
                _ends_soon(pid)
            continue
        os.kill(sleeper, signal.SIGKILL)
    assert results[0] == results[1]
    first, rest, code = results[0]
    assert first == ("to stderr\n", "ready\n")
    if handling == "handled":
        assert (rest, code) == ("stopping\n", 5)
    elif signum == signal.SIGINT:  # KeyboardInterrupt's traceback, then the interpreter's SIGINT
        assert rest.endswith("    time.sleep(60)\nKeyboardInterrupt\n") and code == -signum
    else:
        assert (rest, code) == ("", -signum)


def test_a_shim_killed_with_sigkill_takes_along_the_program_its_command_exec_ed(tmp_path):
    """train.sh's launcher (``python -c``, forked) becomes fairseq-train with ``os.execv``, and the
    shim it execs forks fairseq-train anew. A SIGKILL to the first shim (a test's kill -9) still
    ends that command and its children, as it does for a command that execs nothing."""
    waits = tmp_path / "waits.py"
    waits.write_text(WAITS_WITH_A_CHILD)
    pids = tmp_path / "pids"
    becomes = f"import os, sys; os.execv(sys.executable, [sys.executable, {str(waits)!r}, 'default', {str(pids)!r}])"
    proc = subprocess.Popen([script_python(), "-c", becomes], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=clean_env())
    assert (proc.stdout.readline(), proc.stdout.readline()) == ("to stderr\n", "ready\n")
    command, sleeper = _command_and_child(pids)
    with open(f"/proc/{command}/stat") as stat:  # forked by the server, twice removed from the shim
        assert int(stat.read().rsplit(")", 1)[1].split()[1]) == PRELOADED_PYTHON.process.pid
    proc.kill()
    proc.wait()
    proc.stdout.close()
    for pid in (command, sleeper):
        _ends_soon(pid)


def test_a_command_started_with_sigint_ignored_ignores_it_as_the_interpreter_does(tmp_path):
    """A non-interactive shell starts its background jobs (``make test &``) with SIGINT ignored,
    and a fresh interpreter then never raises KeyboardInterrupt; a forked command keeps that, as it
    keeps the default otherwise (the server's own disposition is not the command's)."""
    script = tmp_path / "waits.py"
    script.write_text(WAITS_FOR_A_SIGNAL)
    results = []
    for python in (script_python(), sys.executable):
        proc = subprocess.Popen([python, script, "default"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=clean_env(),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        first = proc.stdout.readline(), proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        running = proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        results.append((first, running, proc.stdout.read(), proc.wait()))
        proc.stdout.close()
    assert results[0] == results[1] == (("to stderr\n", "ready\n"), True, "", -signal.SIGTERM)
