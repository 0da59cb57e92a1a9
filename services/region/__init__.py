"""The region service: bucket owners that apply operations and fan them out."""
