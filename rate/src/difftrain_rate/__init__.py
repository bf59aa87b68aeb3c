"""difftrain's rating app: people (and scripted raters) rank generated candidates; the answers become DPO pairs.

It installs and runs without torch (``pip install ./rate``), on a small CPU machine beside the cluster.
"""

__version__ = "0.1.0"
