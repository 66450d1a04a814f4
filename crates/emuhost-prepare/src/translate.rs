//! Translation with naga: a program's source (WGSL or GLSL) is parsed and validated once; then,
//! for each variant, its overridable constants are given their values (naga's SPIR-V writer
//! cannot write specialization constants, so the constants are folded into the module) and the
//! result is written as SPIR-V for its compute entry point. All of it is CPU work, no driver.

use naga::back::spv;
use naga::valid::{Capabilities, ValidationFlags, Validator};

use super::corpus::{Language, Program, Variant};

/// A descriptor a pipeline's layout needs: set, binding and kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Binding {
    pub set: u32,
    pub binding: u32,
    pub kind: BindingKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindingKind {
    StorageBuffer,
    UniformBuffer,
}

/// One variant, ready for the driver.
#[derive(Clone, Debug)]
pub struct Spirv {
    pub words: Vec<u32>,
    pub entry_point: String,
    pub workgroup_size: [u32; 3],
    pub bindings: Vec<Binding>,
}

/// A program parsed and validated: its module and the module's analysis.
pub struct Parsed {
    module: naga::Module,
    info: naga::valid::ModuleInfo,
    entry_point: String,
    bindings: Vec<Binding>,
}

/// Parses and validates a program. The error is naga's message, with the source location.
pub fn parse(p: &Program) -> Result<Parsed, String> {
    let module = match p.language {
        Language::Wgsl => naga::front::wgsl::parse_str(&p.source).map_err(|e| e.emit_to_string(&p.source))?,
        Language::Glsl => naga::front::glsl::Frontend::default()
            .parse(&naga::front::glsl::Options::from(naga::ShaderStage::Compute), &p.source)
            .map_err(|e| e.emit_to_string(&p.source))?,
    };
    let info = Validator::new(ValidationFlags::all(), Capabilities::default())
        .validate(&module)
        .map_err(|e| e.emit_to_string(&p.source))?;
    let entry_point = module
        .entry_points
        .iter()
        .find(|e| e.stage == naga::ShaderStage::Compute)
        .map(|e| e.name.clone())
        .ok_or("no compute entry point")?;
    let mut bindings = Vec::new();
    for (_, g) in module.global_variables.iter() {
        let Some(rb) = &g.binding else { continue };
        let kind = match g.space {
            naga::AddressSpace::Storage { .. } => BindingKind::StorageBuffer,
            naga::AddressSpace::Uniform => BindingKind::UniformBuffer,
            other => {
                return Err(format!(
                    "binding {}.{}: {other:?} resources are not supported (storage and uniform buffers only)",
                    rb.group, rb.binding
                ));
            }
        };
        bindings.push(Binding { set: rb.group, binding: rb.binding, kind });
    }
    Ok(Parsed { module, info, entry_point, bindings })
}

impl Parsed {
    /// The SPIR-V of one variant: its constants folded in, then written.
    pub fn variant(&self, v: &Variant) -> Result<Spirv, String> {
        let mut constants = naga::back::PipelineConstants::default();
        for (k, x) in &v.constants {
            constants.insert(k.clone(), *x);
        }
        let stage = Some((naga::ShaderStage::Compute, self.entry_point.as_str()));
        let (module, info) =
            naga::back::pipeline_constants::process_overrides(&self.module, &self.info, stage, &constants)
                .map_err(|e| format!("constants {}: {e}", v.describe()))?;
        let ep = module
            .entry_points
            .iter()
            .find(|e| e.name == self.entry_point)
            .ok_or("the entry point went missing after the constants were applied")?;
        let workgroup_size = ep.workgroup_size;
        let pipeline =
            spv::PipelineOptions { shader_stage: naga::ShaderStage::Compute, entry_point: self.entry_point.clone() };
        let words = spv::write_vec(&module, &info, &spv::Options::default(), Some(&pipeline))
            .map_err(|e| format!("SPIR-V writer: {e}"))?;
        Ok(Spirv { words, entry_point: self.entry_point.clone(), workgroup_size, bindings: self.bindings.clone() })
    }
}

#[cfg(test)]
mod tests {
    use super::super::corpus::{GenConfig, generate};
    use super::*;

    #[test]
    fn every_generated_variant_translates() {
        let c = generate(&GenConfig { programs: 8, variants: 5, ..GenConfig::default() });
        for p in &c.programs {
            let parsed = parse(p).unwrap_or_else(|e| panic!("{}:\n{e}\n{}", p.name, p.source));
            assert_eq!(parsed.bindings.len(), 3, "{}", p.name);
            let mut seen = Vec::new();
            for v in &p.variants {
                let s = parsed.variant(v).unwrap_or_else(|e| panic!("{} {}: {e}", p.name, v.describe()));
                assert_eq!(s.words[0], 0x0723_0203, "SPIR-V magic");
                assert!(!seen.contains(&s.words), "{}: variants must differ", p.name);
                seen.push(s.words);
            }
        }
    }

    #[test]
    fn workgroup_size_follows_the_variant() {
        let c = generate(&GenConfig { programs: 1, variants: 4, glsl_every: 0, ..GenConfig::default() });
        let p = &c.programs[0];
        let parsed = parse(p).unwrap();
        let sizes: Vec<u32> = p.variants.iter().map(|v| parsed.variant(v).unwrap().workgroup_size[0]).collect();
        assert_eq!(sizes, [32, 64, 128, 256]);
    }

    #[test]
    fn broken_programs_fail_with_a_message() {
        let c = generate(&GenConfig { programs: 4, broken_translate: 4, ..GenConfig::default() });
        for p in &c.programs {
            let e = parse(p).err().unwrap_or_else(|| panic!("{} must fail", p.name));
            assert!(!e.is_empty());
        }
    }
}
