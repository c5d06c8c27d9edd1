"""A second, independent numpy reference of the samplec contract (docs: /work/shared/spec/LANGUAGE.md).

`ref` holds the stages, terminals and outputs with knife-edge margin tracking; `tf` holds Threefry-2x32-20.
Both were written from the language contract alone, without reading samplec's code or tests/reference.py;
tests/test_cleanroom.py compares samplec against them.
"""
