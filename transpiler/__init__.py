"""ps-transpiler: rewrite a Fluid `ProgramDesc` into trainer and parameter-server programs."""

__version__ = "0.1.0"
