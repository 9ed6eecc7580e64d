"""The Python environment the launchers run in: the interpreter probe and the wheelhouse."""
