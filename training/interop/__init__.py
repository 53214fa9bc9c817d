"""Moving models between Megalith and other ecosystems (Hugging Face: :mod:`.hf`)."""

from training.interop.hf import HFInteropError, export_hf, import_hf

__all__ = ["HFInteropError", "export_hf", "import_hf"]
