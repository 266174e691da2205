"""Package metadata for zero-infinity-tf: the runtime, the CLI and the TensorBoard plugin."""

from setuptools import find_packages, setup

setup(
    name="zero-infinity-tf",
    version="0.1.0",
    description=(
        "ZeRO-Infinity-style sharding and offloading runtime for TensorFlow, with the "
        "Memory Hierarchy View TensorBoard plugin"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[
        *find_packages(include=["zero_runtime", "zero_runtime.*", "tb_plugin", "tb_plugin.*"]),
        "tb_plugin.static",  # the built frontend (data only; listed so setuptools ships it)
    ],
    package_data={"tb_plugin.static": ["*", "**/*"]},
    include_package_data=True,
    install_requires=[
        # TensorFlow itself is declared through an extra so that CPU-only hosts take the
        # smaller tensorflow-cpu wheel and GPU hosts tensorflow[and-cuda]; one is required.
        "keras>=3.0",
        "tensorboard>=2.16",
        "werkzeug>=2.0",
        "psutil>=5.9",
        "nvidia-ml-py>=12.0",
        "numpy>=1.24",
        # CRC-32C page checksums of the NVMe tier (LGPL-2.1-or-later, used unmodified).
        "crc32c>=2.3",
        # The host optimizer's fused kernels (zero_runtime/optim/numba_kernels.py;
        # BSD-2-Clause). Without it the NumPy kernels run, with a warning.
        "numba>=0.60",
    ],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.16"],
        "gpu": ["tensorflow[and-cuda]>=2.16"],
        "test": [
            "pytest>=8",
            # The suite in two workers (scripts/run_tests.sh; tests/conftest.py groups).
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "playwright>=1.45",
            "ruff>=0.5",
            "tbparse>=0.0.9",
        ],
        # The documentation site (mkdocs.yml; its strict build is a test).
        "docs": [
            "mkdocs>=1.6",
            "mkdocs-material>=9.5",
            "mkdocstrings[python]>=0.26",
        ],
    },
    entry_points={
        "console_scripts": ["zero-runtime = zero_runtime.cli:main"],
        "tensorboard_plugins": ["memory_hierarchy = tb_plugin.loader:MemoryHierarchyLoader"],
    },
)
