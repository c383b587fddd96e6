"""Media: fetching (data URLs, allowed local paths, http with an SSRF guard) and decoding
images and videos under operator-set caps."""
