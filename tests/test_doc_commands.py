"""Every install and launch line of README.md and docs/*.md holds as written
from a clone: what it installs names extras setup.cfg has and nothing PyPI
lacks (mpigrad is installed from the clone), the files and modules it runs
exist, the benchmark's options parse, and its virtual environments are made
before they are entered. The cheap ones run: the benchmark's options."""

import configparser
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the user's own scripts, as the docs name them
PLACEHOLDERS = {"train.py", "script.py", "my_script.py"}


def _commands():
    """(file, command) of every shell command in a bash block or an inline
    code span that installs or launches (split at && and ;)."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        spans = re.findall(r"```bash\n(.*?)```", text, re.S)
        spans += re.findall(r"`([^`\n]*(?:pip install|mpiexec -n|python -m mpigrad|bash scripts/"
                            r"|sbatch scripts/|srun --mpi)[^`\n]*)`", text)
        for span in spans:
            for line in span.splitlines():
                line = line.split(" #", 1)[0].strip()
                for command in re.split(r"\s*(?:&&|;)\s*", line):
                    if re.match(r"(python3? -m venv|\. |pip install|mpiexec -n \S+ python|"
                                r"mpiexec -n \S+ mpigrad-bench|python -m mpigrad|"
                                r"bash scripts/|sbatch scripts/|srun --mpi=\S+ -n \S+ python)",
                                command):
                        found.append((doc.name, command, line))
    return found


COMMANDS = _commands()


def _extras():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return set(config["options.extras_require"])


def test_the_docs_have_install_and_launch_lines():
    names = {doc for doc, _, _ in COMMANDS}
    assert "README.md" in names and "mindspore.md" in names and len(COMMANDS) > 30


@pytest.mark.parametrize("doc, command, line", COMMANDS,
                         ids=[f"{d}: {c[:60]}" for d, c, _ in COMMANDS])
def test_a_doc_command_holds_as_written(doc, command, line):
    words = shlex.split(command.replace("...", ""))
    if words[0] == "pip":
        for word in words[2:]:
            if word.startswith("-"):
                continue
            spec = re.match(r"(.*?)(\[(.*)\])?$", word)
            target, extras = spec.group(1), spec.group(3)
            if extras:
                assert target.startswith((".", "dist/", "/")) or target.endswith(".whl"), (
                    f"{doc}: {word}: mpigrad is not on PyPI; install it from the clone "
                    f"('.[{extras}]')")
                assert set(extras.split(",")) <= _extras(), f"{doc}: {word}: unknown extra"
    elif words[0] == ".":
        venv = words[1].split("/bin/")[0]
        assert f"python3 -m venv {venv}" in line or f"python -m venv {venv}" in line, (
            f"{doc}: `{line}` enters {venv} without making it on the same line")
    elif words[0] in ("bash", "sbatch"):
        assert (ROOT / words[1]).exists(), f"{doc}: {words[1]} does not exist"
    else:
        if words[0] in ("mpiexec", "srun"):
            words = words[words.index("python") if "python" in words else
                          words.index("mpigrad-bench"):]
        if words[0] == "mpigrad-bench" or words[:3] == ["python", "-m", "mpigrad.bench"]:
            from mpigrad.bench.__main__ import _parse
            _parse(words[1:] if words[0] == "mpigrad-bench" else words[3:])
        elif words[:2] == ["python", "-m"]:
            import importlib.util
            assert importlib.util.find_spec(words[2]) is not None, f"{doc}: no {words[2]}"
        elif words[0] == "python" and len(words) > 1 and words[1] not in PLACEHOLDERS:
            assert (ROOT / words[1]).exists(), f"{doc}: {words[1]} does not exist"
