"""The Glyd formats: bf16 split into planes, exponent codes, the weight tensor code and the KV page code.

The layout is written down in docs/format.md; `FORMAT_VERSION` changes whenever a stored byte would.
"""

FORMAT_VERSION = 1
