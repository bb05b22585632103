"""Infrastructure every layer uses: atomic files, the terminal, stop signals."""
