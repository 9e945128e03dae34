"""Fast IPython start-up.

`import IPython.core.interactiveshell` normally runs IPython/__init__.py first, which imports the
terminal front end (prompt_toolkit, IPython.terminal.*): about 90 ms the worker never uses. Instead the
`IPython` package module is created from its real spec without executing __init__.py, with
`get_ipython` filled in (IPython.core needs it). The first access to any other package attribute
(`IPython.__version__`, `IPython.embed`, ...) runs the real __init__.py into the same module object, so
user code sees the complete package. Submodules (`IPython.display`, `from IPython import display`) are
imported directly without that cost.
"""

import importlib
import importlib.util
import os
import sys


def install_lazy_ipython_package():
    if "IPython" in sys.modules:
        return sys.modules["IPython"]
    spec = importlib.util.find_spec("IPython")
    if spec is None or spec.loader is None:
        raise ImportError("IPython is not installed for this Python (Debian package python3-ipython)")
    package = importlib.util.module_from_spec(spec)
    initialised = []

    def complete_package_on_demand(name):
        if name.startswith("__") and name.endswith("__") and name not in ("__version__", "__author__",
                                                                          "__license__"):
            raise AttributeError(name)
        if importlib.util.find_spec(f"IPython.{name}") is not None:
            return importlib.import_module(f"IPython.{name}")
        if not initialised:
            initialised.append(True)
            del package.__getattr__
            spec.loader.exec_module(package)
        try:
            return package.__dict__[name]
        except KeyError:
            raise AttributeError(f"module 'IPython' has no attribute {name!r}") from None

    package.__getattr__ = complete_package_on_demand
    sys.modules["IPython"] = package
    from IPython.core.getipython import get_ipython  # noqa: E402  (needs the package registered first)
    package.get_ipython = get_ipython
    return package


def apply_environment_defaults(environ=os.environ):
    """Defaults a headless, sandboxed kernel needs; explicit settings from the kernel always win."""
    # Figures become image/png display_data at the end of each cell, without plt.show().
    environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # HOME (/workspace) belongs to the agent: keep tool caches and IPython's profile out of it.
    environ.setdefault("MPLCONFIGDIR", "/tmp/matplotlib")
    environ.setdefault("IPYTHONDIR", "/tmp/ipython")
    # No terminal: a pager started by `!git log` or `%less` must not wait for a keyboard (as ipykernel).
    environ.setdefault("PAGER", "cat")
    environ.setdefault("GIT_PAGER", "cat")
    # One BLAS thread: Debian's OpenBLAS (pthread variant) starts a pool of nproc-1 threads when numpy is
    # imported, and a zygote template must be single-threaded to fork (zygote.check_forkable). Exec'd workers
    # get the same default, so a session does not compute differently by how its worker was started; the
    # worker's CPU is its cgroup's quota either way.
    environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    environ.setdefault("OMP_NUM_THREADS", "1")
