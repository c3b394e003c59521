"""batchpilot.operator: the Kopf operator that reconciles InferenceService resources."""
