"""Ships the repo-root ``conf/`` and ``cuda/`` folders inside the wheel.

They stay at the root for users of the checkout (``make``, the README, editable installs read
them there). A built wheel copies them into the package that reads them:
``experiments/conf`` (the Hydra config tree, :data:`experiments.app.train.CONF_DIR`) and
``strategies/cuda`` (the extension sources, :func:`strategies.kernel_build.source_dir`). The sdist
carries the root folders (``MANIFEST.in``), so a wheel built from it gets the same copies.
Everything else is declared in ``pyproject.toml``.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

#: root folder -> package that ships it
BUNDLED = {"conf": "experiments", "cuda": "strategies"}


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # an editable install reads the root folders of the checkout
        for folder, package in BUNDLED.items():
            target = Path(self.build_lib) / package / folder
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(folder, target, ignore=shutil.ignore_patterns("__pycache__", ".*"))


setup(cmdclass={"build_py": BuildPyWithData})
