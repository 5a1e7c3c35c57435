#include <doctest/doctest.h>
TEST_SUITE("faults") {}
