fn programs_placeholder() {}
