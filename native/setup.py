"""samplec-native: optional MLX CPU primitives for samplec (see README.md). Build against the installed MLX:

    pip install nanobind==3.1.0 && pip install --no-build-isolation ./native
"""
from setuptools import setup
from mlx import extension

setup(
    name="samplec-native",
    version="0.1.0",
    description="MLX CPU primitives for samplec's -O2 plans (Threefry RandomBits, fused block selection)",
    ext_modules=[extension.CMakeExtension("samplec_native._ext")],
    cmdclass={"build_ext": extension.CMakeBuild},
    packages=["samplec_native"],
    package_data={"samplec_native": ["*.so"]},
    zip_safe=False,
    python_requires=">=3.9",
)
