"""The units and sentinels of exact sums, shared by their kernels
(mpigrad._base.exact_kernels) and their wrappers (mpigrad._base.exact)."""

__all__ = ["LIMB_BITS", "MAX_TERMS", "SPECIAL", "ZERO", "NONE", "SCALE_ZERO"]

#: bits per limb: an int64 limb holds the sum of up to 2**(62 - LIMB_BITS)
#: ranks' limbs, and a remainder times 2**LIMB_BITS below 2**63
LIMB_BITS = 48
#: the most ranks (and the largest mean degree) an exact sum takes
MAX_TERMS = 1 << (62 - LIMB_BITS)
#: the top exponent of an element with a non-finite addend
SPECIAL = 32767
#: the top (and the negated lowest) exponent of an element that is zero
ZERO = -32768
#: the lowest bit of an element that is zero or special
NONE = 1 << 20
#: the index of 2**0 in the table of powers of two rounded_odd scales by
SCALE_ZERO = 1100
