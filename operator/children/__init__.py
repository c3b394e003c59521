"""Pure builders: an InferenceService's spec in, the children's manifests out.

No I/O here. The reconcile (reconcile.py) parses the object, calls these, and applies the
results with server-side apply under one field manager. Every output is deterministic: the
same inputs give byte-identical manifests, so a re-apply never rolls the Deployment.

One module per child (secret, config_map, pod and deployment, service, autoscaler, pool),
what they share (meta: owner, labels, ports; plan: what the spec asks to run; engine_args;
quantity), and build, which puts them together in apply order.
"""
