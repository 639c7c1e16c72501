"""The install layout: every package of the source tree is in pyproject.toml's list.

CI installs in editable mode, which maps whole folders and so hides a package missing from
``[tool.setuptools] packages``; a plain ``pip install .`` (a wheel) then leaves it out, and
``register_ops`` fails on the first compile (``ssm_compile.kernels.x_dt_proj`` was missing this
way). This checks the list against the folders, the way setuptools builds the wheel from it.
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _setuptools_table() -> tuple[dict, list]:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: no tomllib; the two entries are simple enough to read here.
        dirs = dict(re.findall(r'"([\w.]+)"\s*=\s*"([\w/]+)"', re.search(r"package-dir = \{(.*?)\}", text).group(1)))
        packages = re.findall(r'"([\w.]+)"', re.search(r"packages = \[(.*?)\]", text, re.S).group(1))
        return dirs, packages
    table = tomllib.loads(text)["tool"]["setuptools"]
    return table["package-dir"], table["packages"]


def _source_packages(dirs: dict) -> set[str]:
    """Installed package names of every folder holding an ``__init__.py`` below the mapped roots."""
    found = set()
    for name, folder in dirs.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            if "__pycache__" in rel:
                continue
            found.add(".".join((name, *rel)))
    return found


def test_every_source_package_is_installed():
    dirs, packages = _setuptools_table()
    missing = _source_packages(dirs) - set(packages)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {sorted(missing)}"


def test_every_listed_package_exists():
    dirs, packages = _setuptools_table()
    stale = set(packages) - _source_packages(dirs)
    assert not stale, f"pyproject.toml lists packages with no folder: {sorted(stale)}"


def test_the_source_tree_has_the_packages_the_code_imports():
    # A guard on the test itself: the walk must see the nested kernel packages, or the first
    # test above could not fail.
    dirs, _ = _setuptools_table()
    found = _source_packages(dirs)
    assert {"ssm_compile.kernels.x_dt_proj", "ssm_compile.kernels.selective_scan", "ssm_compile.passes"} <= found
