"""The snapshot repository: templates and snapshots as content-addressed chunks on disk or in S3."""
