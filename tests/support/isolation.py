"""Python source that makes a subprocess unable to import this repository (PYTHONPATH entry,
editable-install finders), so a test can prove a checkpoint works with its remote code alone.
The subprocess receives the repository's path as sys.argv[1]."""

import textwrap

WITHOUT_THIS_REPO = textwrap.dedent(
    """
    import importlib.util, sys
    repo = sys.argv[1]
    sys.path[:] = [p for p in sys.path if p.rstrip("/") != repo]
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
    sys.path_importer_cache.clear()
    for name in ("modeling_dflash2", "trainer"):
        assert importlib.util.find_spec(name) is None, f"{name} must not be importable"
    """
)
