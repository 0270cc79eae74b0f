"""Speculative decoding: proposers (one per file), the lossless verifier, and the policy choosing k."""
