"""The one error type of the conversion: its message is a single line that names the file or
flag at fault and the fix."""


class ConversionError(ValueError):
    """Input the conversion cannot use (a file, a config.json field or a flag)."""
