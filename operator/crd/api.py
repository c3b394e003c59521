"""The API's identity: group, version, kind and the names kubectl knows it by."""

from __future__ import annotations

GROUP = "batchpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["bpis"]  # "isvc" belongs to KServe
