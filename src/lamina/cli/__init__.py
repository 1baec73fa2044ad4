"""The ``lamina`` command line (:mod:`lamina.cli.main`).

Before any of its modules imports numpy, the command line starts OpenBLAS with one thread
(:mod:`lamina.blas`): this package is imported first, by the console script and by
``python -m lamina`` alike.
"""

from lamina import blas

blas.one_thread()
