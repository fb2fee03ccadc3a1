"""Packaging for tangram-launch.  Install:  pip install -e ".[test]" -c constraints.txt"""
from setuptools import find_packages, setup

setup(
    name="tangram-launch",
    version="0.1.0",
    description="Plan and launch LLM training on heterogeneous GPU clusters (Tangram)",
    python_requires=">=3.10",
    packages=find_packages(include=["tangram_launch*", "profiler*", "runtime_adapters*"]),
    package_data={"tangram_launch": ["specs/*.yaml", "*.json", "models/*.yaml"]},
    install_requires=["torch==2.13.0", "numpy", "pyyaml>=6", "nvidia-ml-py>=12"],  # numpy: torch <-> numpy in the profiler
    extras_require={
        "deepspeed": ["deepspeed==0.19.8"],
        "megatron": ["megatron-core==0.16.1"],
        "draw": ["matplotlib"],  # PNG timelines; SVG needs nothing
        "hf": ["transformers==5.23.0", "safetensors==0.8.0"],  # train Hugging Face models (runtime_adapters.hf_model)
        "test": ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6", "jsonschema>=4", "import-linter>=2.17",
                 "deepspeed==0.19.8", "megatron-core==0.16.1", "transformers==5.23.0", "safetensors==0.8.0"],
    },
    entry_points={
        "console_scripts": ["tangram-launch=tangram_launch.cli:main"],
        "tangram_launch.parallelizers": [],
    },
)
