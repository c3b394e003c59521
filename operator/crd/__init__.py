"""The InferenceService API (group batchpilot.dev, version v1alpha1), defined once.

The pydantic models are the single source of the schema:

- the operator parses every object's spec with them (``spec.parse_spec``: typed access,
  the same defaults the API server applies, and the same cross-field rules as the CRD's
  CEL);
- ``manifests.crd_manifest()`` walks them (``schema.py``) into the CRD's structural OpenAPI
  v3 schema, and ``batchpilot operator crds`` writes it to ``crds/`` (a test fails when
  that file is stale).

Field docstrings become the schema's descriptions (``kubectl explain bpis.spec.engine``).
Cross-field rules are declared once as ``Rule(cel, message, check)`` (``base.py``): the CEL
goes into ``x-kubernetes-validations`` and ``check`` is the same predicate in Python.

Modules: ``api`` (group, version, kind), ``base`` (schema hints, rules, the base model),
``spec`` (the spec and its parsing) with its parts ``engine``, ``autoscaling``, ``tuning``,
``routing`` and ``pod``, ``status``, ``schema`` (pydantic to OpenAPI) and ``manifests``
(the CRDs as written to ``crds/``).
"""
