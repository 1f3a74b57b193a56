"""The package's version, in a module of its own: ``profclass/__init__`` names the submodules
that import it (typing-only), so they read the version here, not from the package."""
__version__ = "0.1.0"
