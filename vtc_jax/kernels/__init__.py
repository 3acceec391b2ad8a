"""Kernel templates with virtual tensor I/O (``vio``): matmul, decode attention, pointwise,
reduction, convolution; shared block/grid helpers in ``tiling``. ``examples()`` lists each
template in its default configuration."""


def examples():  # noqa: ANN201 - imported lazily: the catalogue pulls in every template
    from .catalog import examples as _examples
    return _examples()
