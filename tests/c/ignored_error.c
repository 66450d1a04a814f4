/* A program that ignores an error: it must NOT compile under -Werror=unused-result (as C and as
 * C++). Every emuhost call returning an emuhost_error_t * is EMUHOST_MUST_USE (GCC's and Clang's
 * warn_unused_result): an ignored error is a leak and a failure nobody sees. Checked by
 * crates/emuhost-capi/tests/it/programs.rs (an_ignored_error_fails_to_compile). */
#include "emuhost.h"

#include <stddef.h>

int main(void) {
    emuhost_space_t *space = NULL;
    emuhost_space_reserve(1u << 20, 0, &space); /* the error ignored */
    return space == NULL;
}
