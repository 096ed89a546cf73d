"""The codecs of the preset fits kvtool ships (``kvtool/data/preset-fits-*.json``: Gemma 3 270M's
``quality``, ``balanced`` and ``small``, keys then values), for the tests that check every
backend writes the reference codes for them. ``tests/test_turbomix_kernels.py`` checks this
list covers every shipped fit."""

SHIPPED_FIT_CODECS = [
    "turbomix:bits=4,outliers=16,outliers_per=64,outlier_bits=6,center=true,candidates=4,"
    "norm_bits=8",
    "turbomix:outliers=16,outliers_per=64,candidates=4,norm_bits=8",
    "turbomix:outliers=32,outliers_per=64,center=true,candidates=4,select=scalar,trellis=true,"
    "norm_bits=8",
    "turbomix:bits=2,outliers=48,outliers_per=64,outlier_bits=3,candidates=4,select=scalar,"
    "trellis=true,norm_bits=8",
    "turbomix:bits=2,outliers=16,outliers_per=64,outlier_bits=4,center=true,candidates=4,"
    "select=scalar,trellis=true",
    "turbomix:bits=2,outliers=16,outliers_per=64,outlier_bits=3,candidates=4,select=scalar,"
    "trellis=true",
]
