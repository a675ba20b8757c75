"""``scalelab-doctor``: the CLI, the diagnosis of a stopped run, and the labelled fault suite.
"""
