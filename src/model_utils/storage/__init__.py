"""Files and objects: checksummed manifests, atomic writes, S3."""
