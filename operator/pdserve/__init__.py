"""pdserve: disaggregated (prefill / decode / render) vLLM serving on Kubernetes."""

from __future__ import annotations

__version__ = "0.1.0"
