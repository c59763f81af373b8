"""The custom resource's identity: what the CRD, the operator's watch and the client agree on."""

from __future__ import annotations

GROUP = "pdserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggregatedModel"
PLURAL = "disaggregatedmodels"
SINGULAR = "disaggregatedmodel"
SHORT_NAMES = ("dm", "dmodel")
