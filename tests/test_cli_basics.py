import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-c", "import sys; from flare.cli.flare import main; sys.exit(main(sys.argv[1:]))", *args],
                          capture_output=True, text=True)


def test_help_run_exits_zero_and_describes_run():
    result = run("help", "run")
    assert result.returncode == 0
    assert "usage: flare run" in result.stdout


def test_unknown_command_is_a_usage_error_on_stderr():
    result = run("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr
    assert result.stdout == ""
