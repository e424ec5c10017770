"""int8 weight rows times their scales, in the compute dtype: what a prompt's matmul with int8 weights takes."""
