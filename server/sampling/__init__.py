"""Choosing each step's tokens: the sampling parameters a request carries
(sampling_params), penalties and logit bias applied to the logits (penalties), the
sampler itself (sampler) and the logprobs it reports (logprobs)."""
