"""Build hook for the optional C line encoder; all metadata lives in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and
``traceml_records`` uses its pure-Python encoder, which writes the same bytes.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "traceml_records._speedups",
            sources=["src/traceml_records/_speedups.c"],
            optional=True,
        )
    ]
)
