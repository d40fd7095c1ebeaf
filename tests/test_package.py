"""The package: pyproject.toml installs nanofp8/ (and only it), and its requirements are
requirements.txt's.

The install test runs pip offline: a fresh virtualenv that sees this environment's packages
(setuptools to build with, torch and the rest to import), `--no-build-isolation` (no download of
setuptools), `--no-deps` and `--no-index` (nothing fetched). It copies the sources it needs into a
temporary folder first, because setuptools writes build/ and nanofp8.egg-info beside them.
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import pytest

import nanofp8

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _requirement(line):
    """'name>=1.0   # comment' -> ('name', '>=1.0'); the name lower-cased, '_' as '-' (pip's rule)."""
    spec = line.split("#")[0].strip()
    name, rest = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", spec).groups()
    return name.lower().replace("_", "-"), rest.replace(" ", "")


def test_requirements_txt_lists_the_package_requirements():
    """requirements.txt (what CI installs) holds exactly pyproject.toml's requirements: the
    package's own, the scripts' and the tests', with the same version bounds."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    declared = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    with open(os.path.join(REPO, "requirements.txt")) as f:
        listed = [line for line in f if line.split("#")[0].strip()]
    assert sorted(map(_requirement, declared)) == sorted(map(_requirement, listed))


def _fresh_venv(path):
    """A virtualenv without pip of its own that sees this environment's site-packages after its
    own (a .pth file): what it installs comes first, the rest (pip, setuptools, torch) from here."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    python = os.path.join(path, "bin", "python")
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(own, "outer.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True], ids=["install", "editable"])
def test_pip_install_then_import_from_elsewhere(tmp_path, editable):
    """pip install . (and -e .) in a fresh virtualenv: nanofp8 imports from another folder, from
    the install (not from the repo), with the version of nanofp8/__init__.py; kernels.py, a script
    of the repo, is not installed, and the library imports without it."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "kernels.py", "train.py"):
        shutil.copy(os.path.join(REPO, name), src / name)
    shutil.copytree(os.path.join(REPO, "nanofp8"), src / "nanofp8", ignore=shutil.ignore_patterns("__pycache__"))
    python = _fresh_venv(str(tmp_path / "venv"))
    install = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run(install + (["-e", str(src)] if editable else [str(src)]), check=True)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (src / "data").mkdir()  # the checkout's datasets (an editable install reads them)
    probe = ("import importlib.util, nanofp8, nanofp8.model, nanofp8.data, nanofp8.device\n"
             "print(nanofp8.__version__, nanofp8.__file__, importlib.util.find_spec('kernels') is None, "
             "nanofp8.data.data_dir('shakespeare_char'))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NANOFP8_DATA")}
    out = subprocess.run([python, "-c", probe], cwd=elsewhere, env=env, check=True, capture_output=True, text=True)
    version, where, no_kernels, data = out.stdout.split()
    assert version == nanofp8.__version__
    home = src if editable else tmp_path / "venv"
    assert os.path.realpath(where).startswith(os.path.realpath(home)), where
    assert no_kernels == "True"
    # the data: the checkout's beside an editable install; an installed package has none beside it
    # (site-packages/data would be a folder of the environment), so it reads ./data as nanoGPT does
    assert data == str((src if editable else elsewhere) / "data" / "shakespeare_char")
    out = subprocess.run([python, "-c", probe], cwd=elsewhere, env={**env, "NANOFP8_DATA": str(tmp_path / "mine")},
                         check=True, capture_output=True, text=True)
    assert out.stdout.split()[3] == str(tmp_path / "mine" / "shakespeare_char")
