#include <doctest/doctest.h>
TEST_SUITE("engine") {}
