"""The dedup stage: image_hashes, phash_clusters, and the sensor that keeps decisions current."""
