"""multipath_nmt: a fairseq plug-in for Multi-Path Transformers, shared-MoE encoders, EWA and ParameterNet."""
from setuptools import find_packages, setup

setup(
    name="multipath_nmt",
    version="0.1.0",
    description="Multi-Path Transformer, WideNet, EWA and ParameterNet for fairseq NMT",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["multipath_nmt", "multipath_nmt.*"]),
    install_requires=[
        # fairseq 0.12.2 does not install on Python >= 3.11; ve-fairseq is the same
        # 0.12 code base with prebuilt cp311/cp312 wheels (see README, "Why ve-fairseq").
        "ve-fairseq==0.12.3",
        "torch>=2.1",
        "numpy>=1.24",
        "sacremoses>=0.1",
        "subword-nmt>=0.3.8",
        "sacrebleu>=2.3",
        "matplotlib>=3.7",
    ],
    # import-linter checks the layering of docs/architecture.md (.importlinter, make test)
    # ctranslate2: the CTranslate2 round trip of tests/test_serving.py (docs/serving.md)
    # iopath: fairseq's --write-checkpoints-asynchronously (tests/test_checkpoints.py); with it
    # installed, fairseq's PathManager routes every file operation through ioPath, as users see
    # pytest-xdist: both test commands run in 2 processes; filelock: the trained fixtures they
    # share are built by one of them (tests/conftest.py)
    # transformers, optimum-onnx (optimum's ONNX exporter and its ONNX Runtime models) and
    # onnxruntime: multipath-export-hf's round trips in tests/test_export_hf.py
    # (docs/serving.md); optimum-onnx 0.1 caps transformers below 4.58
    extras_require={"test": ["pytest>=7", "import-linter>=2.5", "ctranslate2>=4",
                             "iopath>=0.1.10", "pytest-xdist>=3", "filelock>=3",
                             "transformers>=4.57,<4.58", "optimum>=2.1", "optimum-onnx>=0.1",
                             "onnxruntime>=1.20"]},
    entry_points={
        "console_scripts": [
            "multipath-average=multipath_nmt.cli.average:main",
            "multipath-score=multipath_nmt.cli.score:main",
            "multipath-params=multipath_nmt.cli.params:main",
            "multipath-inspect=multipath_nmt.cli.inspect:main",
            "multipath-convert-ewa=multipath_nmt.cli.convert_ewa:main",
            "multipath-plot-log=multipath_nmt.cli.plot_log:main",
            "multipath-bench=multipath_nmt.cli.bench:main",
            "multipath-prepare=multipath_nmt.cli.prepare:main",
            "multipath-make-corpus=multipath_nmt.cli.make_corpus:main",
            "multipath-ctranslate2=multipath_nmt.cli.ctranslate2:main",
            "multipath-export-hf=multipath_nmt.cli.export_hf:main",
        ]
    },
)
